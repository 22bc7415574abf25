"""Which requests run in the next step: continuous batching with chunked prefill.

Each step takes, in order, one decode token of every running request that has finished its
prefill, then prefill chunks of the others (oldest first) within ``max_batch_tokens``::

    budget 8    running: A (decoding)  B (decoding)  C (prompt 20, 4 done)
    step        [A][B][C C C C C C]    C's chunk of 6; its next chunk comes next step

Requests join between steps, in arrival order, while there is a running slot and their
device footprint fits: every running request's pages of one layer at its full length
(prompt + max_tokens), twice (the leased layer and the one being prefetched). A request that
does not fit waits for others to leave; one that could never fit is refused at submission.

With ``share_prefill``, a request whose first page of prompt is that of a running request still
prefilling its prompt waits until that prompt is computed: its shared pages are then cached and
loaded, not computed twice (requests that arrive together with one system prompt).
"""

from __future__ import annotations

from collections import deque

from tierkv.errors import InvalidInputError
from tierkv.serving.request import Request


class Scheduler:
    """The waiting queue and the running set (owned by the engine's loop).

    Args:
        max_running: requests that decode together at most.
        max_batch_tokens: tokens in one step at most (decode tokens plus prefill chunks).
        layer_pages: device pages the running requests may hold in one layer.
        page_tokens: tokens per page.
        share_prefill: hold a request back while another computes the same first page.
    """

    def __init__(
        self,
        max_running: int,
        max_batch_tokens: int,
        layer_pages: int,
        page_tokens: int,
        share_prefill: bool = False,
    ) -> None:
        if max_running < 1 or max_batch_tokens < 1:
            raise InvalidInputError("max_running and max_batch_tokens must be >= 1")
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.layer_pages = layer_pages
        self.page_tokens = page_tokens
        self.share_prefill = share_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._held = 0  # layer pages of the running requests at their full length

    def pages(self, req: Request) -> int:
        """One layer's pages of ``req`` at its full length."""
        return -(-req.total_len // self.page_tokens)

    def could_fit(self, req: Request) -> bool:
        """Whether ``req`` fits when it runs alone."""
        return self.pages(req) <= self.layer_pages

    def add(self, req: Request) -> None:
        """Queue a request (FIFO)."""
        self.waiting.append(req)

    def admit(self) -> list[Request]:
        """Move the waiting requests that fit now to the running set (no overtaking)."""
        out: list[Request] = []
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            need = self.pages(req)
            if self.running and self._held + need > self.layer_pages:
                break  # waits for a running request to leave
            if self.share_prefill and self.prefix_in_prefill(req) is not None:
                break  # waits for the shared pages to be computed once
            self.waiting.popleft()
            self.running.append(req)
            self._held += need
            out.append(req)
        return out

    def prefix_in_prefill(self, req: Request) -> Request | None:
        """A running request still prefilling a prompt whose first page is ``req``'s, under
        the same cache salt (another salt's pages are never shared: nothing to wait for)."""
        t = self.page_tokens
        if len(req.prompt) <= t:
            return None
        head = req.prompt[:t]
        for r in self.running:
            if r.prefilling and len(r.prompt) > t and r.prompt[:t] == head and r.salt == req.salt:
                return r
        return None

    def remove(self, req: Request) -> None:
        """Take a request out (finished, cancelled or failed); a no-op if it is not here."""
        if req in self.running:
            self.running.remove(req)
            self._held -= self.pages(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def plan(self) -> list[tuple[Request, list[int]]]:
        """The next step: ``(request, tokens to run)`` for the running requests that run."""
        budget = self.max_batch_tokens
        step: list[tuple[Request, list[int]]] = []
        for req in self.running:
            if not req.prefilling and not req.finished and budget > 0:
                step.append((req, req.next_input(1)))
                budget -= 1
        for req in self.running:
            if req.prefilling and not req.finished and budget > 0:
                chunk = req.next_input(budget)
                step.append((req, chunk))
                budget -= len(chunk)
        return step
