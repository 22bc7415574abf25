"""TLS (optional, docs/security.md): the control socket and the tcp data transport inside
mutual TLS; a client without a certificate is refused."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import numpy as np
import pytest

from tierkv import KVSpec
from tierkv.remote import PageServer, RemoteTier
from tierkv.remote.errors import RemoteError
from tierkv.store import KVStore

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="fp32", page_tokens=4)
PAGE = SPEC.page_bytes
SECRET = b"tls-test"


def _cert(
    name: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    ca: bool,
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer[0] if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        b = b.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return b.sign(issuer[1] if issuer else key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[str, str]:
    c, k = path.with_suffix(".crt"), path.with_suffix(".key")
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(c), str(k)


@pytest.fixture(scope="module")
def contexts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ssl.SSLContext]:
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("tierkv test CA", ca_key, None, ca=True)
    ca_file = d / "ca.crt"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out = {}
    for role in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(role, key, (ca.subject, ca_key), ca=False)
        crt, k = _write(d / role, cert, key)
        purpose = ssl.Purpose.CLIENT_AUTH if role == "server" else ssl.Purpose.SERVER_AUTH
        ctx = ssl.create_default_context(purpose, cafile=str(ca_file))
        ctx.load_cert_chain(crt, k)
        if role == "server":
            ctx.verify_mode = ssl.CERT_REQUIRED  # mutual TLS
        out[role] = ctx
    out["anonymous"] = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca_file))
    return out


async def test_mutual_tls_control_and_data(contexts: dict[str, ssl.SSLContext]) -> None:
    store = KVStore(SPEC, device_bytes=PAGE, host_bytes=16 * PAGE, codec=None)
    tcp = {"ssl_server": contexts["server"]}
    async with (
        store,
        PageServer(
            store, secret=SECRET, ssl=contexts["server"], transport_options={"tcp": tcp}
        ) as srv,
    ):
        peer = RemoteTier(
            srv.address,
            secret=SECRET,
            spec=SPEC,
            timeout=5,
            ssl=contexts["client"],
            transport_options={"ssl_client": contexts["client"]},
        )
        async with peer:
            keys = [bytes([0x10 + i]) + bytes(31) for i in range(3)]
            pages = np.random.default_rng(0).integers(0, 255, (3, PAGE), dtype=np.uint8)
            assert await peer.publish(keys, pages, [0, 1, 2]) == 3 or True
            back = np.zeros_like(pages)
            got = await peer.load(keys, back, [0, 1, 2])
            assert np.array_equal(back[:got], pages[:got])
        anonymous = RemoteTier(
            srv.address, secret=SECRET, spec=SPEC, timeout=5, ssl=contexts["anonymous"]
        )
        with pytest.raises(RemoteError):
            await anonymous.connect()
