"""What both ends of a page server's control connection share, so neither imports the other::

    wire.py       the messages, their decode limits, roles, error codes, spec_fields
    control.py    Control: the dialling end of a control connection (clients, watches, and
                  the page servers' links to each other)
    exposure.py   the secret a server or client uses, and the address checks of the secure
                  defaults (loopback only without a secret)

Framing, the mutual handshake and the frame tags are tierkv.transports.session (one stack for
every control channel). The modules are imported by path (this file re-exports nothing).
"""
