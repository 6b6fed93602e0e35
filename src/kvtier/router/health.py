"""Active health checks: `GET /health` on every replica every `health_interval_s`.

A replica is down after `unhealthy_after` consecutive failed checks: it leaves the candidate set.
A check that is only late (a replica busy on a small machine answers /health slowly) keeps it a
candidate until then; a refused connection (no process listens) takes it out at once. Once down,
`on_down(name)` purges what the router knew of its cache at the first failed check that shows
the cache gone or going: a refused connection (the process is gone: a restart empties its
cache), an error answer or a cut connection (vLLM answers 503 once its engine died). Checks that
only time out purge nothing: the process is alive but slow or stopped (or its node cut off),
keeps its cache, and nothing would re-send that state when it answers again; the router does
not route to it meanwhile, and a restart after all is told by a refused check or by its KV
events (a new epoch, a sequence going back). One good check brings it back; its /v1/models is
then (re)read, and every `models_refresh_s` while it stays healthy, for model ids (LoRA
adapters: the cards with a `parent`) and `max_model_len`, and its /metrics for the engine's KV
block size (`vllm:cache_config_info`), which the router hashes prompts by. A failed forward
marks a replica suspect at once (`healthy = False`, no purge) so concurrent requests avoid it
until the next good check.

Gray failures: a replica whose /health answers while its engine hangs. With `stall_after_s`
set, a replica holding requests that got no byte from it for that long is sent a probe (a
1-token completion, in its own task so the checks of the others go on). No answer within
`stall_after_s` (a timeout, a refused or cut connection, a 5xx): it is stalled (out of rotation,
`on_stall(name)`, its requests abandoned: see `Replica.abandon_requests`; its cache is kept, no
purge), and is probed again every check until a probe is answered. A 4xx answer cannot tell (a
replica that wants credentials the probe lacks): the replica is kept. The last replica in
rotation is never stalled out: when every replica stalls at once, the host or the router is the
likelier cause, and failing every request over to nothing would turn a pause into errors.

Stopping replicas: one that refused a request as a draining vLLM does (`Replica.stopping`, set
by `kvtier.router.upstream`) keeps answering /health, so a good check does not bring it back.
Each check sends it the same 1-token probe instead: an answer below 500 means it serves again
(a wrong guess costs one check interval). A failed check ends the state: the process is going or
gone, and the checks above take over (a restart comes back through a good check, as any replica
that was down). A check that is only late does not: a draining vLLM busy with what it holds
answers /health slowly, and a good check after it must not bring it back.

Lost nodes: a replica out of rotation whose requests have had no byte for a check timeout is
tested with a fresh TCP connection. A process that hangs or is only slow still has a kernel that
accepts it, and a closed port refuses it (a replica shutting down finishes what it holds); a node
that is gone or cut off answers nothing (a timeout, no route). Then its connections can bring
nothing back, though they may never be reset: it is unreachable, `on_unreachable(name)`, its
requests abandoned like a stalled replica's, rather than waiting out `read_timeout_s`.

Replicas that leave the set (discovery drops them): a check or probe of one still under way
when it leaves reports nothing (`on_down`, `on_stall`, `on_unreachable` are never called for a
replica no longer in the set, so its metrics series stay dropped), and the next round forgets
that it was purged.

Owner: the router app; `run()` is one asyncio task, cancelled on shutdown. Every request goes
through the router's one HTTP client (`kvtier.net.http_client.HttpPool`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable

from kvtier.net.http_client import CONTROL_ANSWER_BYTES, HttpPool
from kvtier.router.replicas import Replica, ReplicaSet

__all__ = ["HealthChecker", "engine_block_tokens"]

log = logging.getLogger(__name__)

_JSON_REQUEST = (("Content-Type", "application/json"),)

_BLOCK_SIZE = re.compile(rb'^vllm:cache_config_info\{[^}]*\bblock_size="(\d{1,9})"', re.MULTILINE)


def engine_block_tokens(metrics_text: bytes) -> int | None:
    """The engine's KV block size from a vLLM /metrics page (None when it does not say)."""
    match = _BLOCK_SIZE.search(metrics_text)
    return int(match.group(1)) if match else None


class HealthChecker:
    def __init__(
        self,
        pool: HttpPool,
        replicas: ReplicaSet,
        interval_s: float,
        timeout_s: float,
        unhealthy_after: int,
        on_down: Callable[[str], None],
        stall_after_s: float = 0.0,
        on_stall: Callable[[str], None] = lambda name: None,
        on_unreachable: Callable[[str], None] = lambda name: None,
        models_refresh_s: float = 0.0,
    ) -> None:
        self._pool = pool
        self._replicas = replicas
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._unhealthy_after = unhealthy_after
        self._on_down = on_down
        self._stall_after_s = stall_after_s
        self._on_stall = on_stall
        self._on_unreachable = on_unreachable
        self._models_refresh_s = models_refresh_s
        self._probes: dict[str, asyncio.Task[None]] = {}
        self._purged: set[str] = set()
        """Replicas `on_down` was called for since their last good check."""

    async def check_all(self) -> None:
        """Check every replica. A check that fails unexpectedly (a bug, an absurd answer) is
        logged and skipped: it never stops the other replicas' checks or later rounds."""
        replicas = list(self._replicas)
        self._purged &= {replica.name for replica in replicas}  # (forget those that left)
        results = await asyncio.gather(*map(self._check, replicas), return_exceptions=True)
        for replica, result in zip(replicas, results, strict=True):
            if isinstance(result, Exception):
                log.error("health check of %s failed: %r", replica.name, result)

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self._interval_s)
                await self.check_all()
        finally:
            for probe in self._probes.values():
                probe.cancel()

    async def _check(self, replica: Replica) -> None:
        answer = await self._health(replica)
        ok, refused = answer == "ok", answer == "refused"
        if ok:
            self._purged.discard(replica.name)
        if ok and self._suspect_stall(replica):
            self._probes[replica.name] = asyncio.create_task(self._probe(replica))
        elif ok and replica.stopping and replica.name not in self._probes:
            self._probes[replica.name] = asyncio.create_task(self._probe_stopping(replica))
        if ok and (replica.stalled or replica.stopping):
            replica.failed_checks = 0
            return
        if ok:
            if not replica.healthy or not replica.models or self._learn_due(replica):
                await self._learn(replica)
            replica.failed_checks = 0
            replica.healthy = True
            return
        if not self._member(replica):
            return
        replica.failed_checks += 1
        if answer != "late":  # going or gone: the checks below take over
            replica.stopping = False
        if refused or replica.failed_checks >= self._unhealthy_after:
            replica.healthy = False
        if (
            replica.failed_checks >= self._unhealthy_after
            and answer != "late"
            and replica.name not in self._purged
        ):
            self._purged.add(replica.name)
            self._on_down(replica.name)
        if not refused and replica.failed_checks >= self._unhealthy_after:
            await self._give_up_if_unreachable(replica)

    def _member(self, replica: Replica) -> bool:
        """Whether `replica` is still in the set (not dropped while checked or probed)."""
        return self._replicas.replicas.get(replica.name) is replica

    async def _health(self, replica: Replica) -> str:
        """The outcome of one /health check: ok (a 200), refused (no process listens), late
        (no whole answer within the timeout) or failed (an error answer, a cut connection)."""
        try:
            status, _ = await self._request(replica, "/health", self._timeout_s)
        except ConnectionRefusedError:
            return "refused"
        except TimeoutError:
            return "late"
        except OSError:
            return "failed"
        return "ok" if status == 200 else "failed"

    async def _give_up_if_unreachable(self, replica: Replica) -> None:
        """Abandon the requests of a replica out of rotation that sent nothing for a check
        timeout and takes no new connection within one (see the module docstring)."""
        silent_s = replica.no_progress_s(time.monotonic())
        if silent_s < self._timeout_s or await self._pool.host_answers(
            replica.settings.url, self._timeout_s
        ):
            return
        abandoned = replica.abandon_requests("unreachable: no connection")
        if abandoned:
            log.warning(
                "replica %s unreachable: no new connection within %.1f s and no byte for %.0f s; "
                "%d of its requests failed over or cut",
                replica.name,
                self._timeout_s,
                silent_s,
                abandoned,
            )
            if self._member(replica):
                self._on_unreachable(replica.name)

    def _suspect_stall(self, replica: Replica) -> bool:
        """Whether to probe it now: stalled, or holding requests without progress for long."""
        if not self._stall_after_s or not replica.models or replica.name in self._probes:
            return False
        return replica.stalled or replica.no_progress_s(time.monotonic()) > self._stall_after_s

    async def _answers_probe(self, replica: Replica, timeout_s: float) -> bool:
        """Whether a 1-token completion is answered below 500 within `timeout_s` (a 4xx cannot
        tell: a replica wanting credentials the probe lacks)."""
        model = replica.models[0] if replica.models else ""
        body = json.dumps({"model": model, "prompt": "ping", "max_tokens": 1})
        try:
            status, _ = await self._request(replica, "/v1/completions", timeout_s, body.encode())
            return status < 500
        except (TimeoutError, OSError):
            return False
        finally:
            self._probes.pop(replica.name, None)

    async def _probe_stopping(self, replica: Replica) -> None:
        """A stopping replica that answers a completion serves again."""
        if await self._answers_probe(replica, self._timeout_s) and replica.stopping:
            log.warning("replica %s answers a completion again: back in rotation", replica.name)
            replica.stopping = False

    async def _probe(self, replica: Replica) -> None:
        """One 1-token completion: answered, the replica makes progress; not, it stalled."""
        answered = await self._answers_probe(replica, self._stall_after_s)
        if not self._member(replica):
            return
        if answered:
            replica.last_progress = time.monotonic()
            if replica.stalled:
                log.warning("replica %s answers again: back in rotation", replica.name)
            replica.stalled = False
            return
        if not replica.stalled and not self._replicas.others_in_rotation(replica):
            log.warning(
                "replica %s: no answer for %.0f s, but no other replica is in rotation: kept "
                "(a stall of the whole fleet points at the host or the router, not one replica)",
                replica.name,
                replica.no_progress_s(time.monotonic()),
            )
            return
        if not replica.stalled:
            abandoned = replica.abandon_requests("stalled: no progress")
            log.warning(
                "replica %s stalled: no answer for %.0f s while /health answers; out of "
                "rotation, %d of its requests failed over or cut",
                replica.name,
                replica.no_progress_s(time.monotonic()),
                abandoned,
            )
            self._on_stall(replica.name)
        replica.stalled = True
        replica.healthy = False

    async def _get(self, replica: Replica, path: str) -> bytes | None:
        """The body of a 200 answer within the timeout, else None."""
        try:
            status, body = await self._request(replica, path, self._timeout_s)
        except (TimeoutError, OSError):
            return None
        return body if status == 200 else None

    async def _request(
        self, replica: Replica, path: str, timeout_s: float, json_body: bytes | None = None
    ) -> tuple[int, bytes]:
        """(status, body) of a GET of `path`, or of a POST of `json_body`, answered whole
        within `timeout_s`; raises `TimeoutError` or an `OSError` otherwise."""
        url = replica.settings.url
        async with asyncio.timeout(timeout_s):
            if json_body is None:
                resp = await self._pool.get(url, path)
            else:
                resp = await self._pool.post(url, path, json_body, _JSON_REQUEST)
            try:
                return resp.status, await resp.read(CONTROL_ANSWER_BYTES)
            finally:
                resp.close()

    def _learn_due(self, replica: Replica) -> bool:
        """Whether a healthy replica's models are due for a re-read (`models_refresh_s`)."""
        refresh = self._models_refresh_s
        return refresh > 0 and time.monotonic() - replica.learned_at >= refresh

    async def _learn(self, replica: Replica) -> None:
        """Model ids (LoRA adapters apart) and lengths from /v1/models, the engine block size
        from /metrics."""
        replica.learned_at = time.monotonic()
        metrics = await self._get(replica, "/metrics")
        if metrics is not None:
            replica.block_tokens = engine_block_tokens(metrics) or replica.block_tokens
        body = await self._get(replica, "/v1/models")
        try:
            doc = json.loads(body) if body is not None else None
        except (ValueError, RecursionError):  # (nested past the parser's recursion limit)
            return
        entries = doc.get("data") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            return
        cards = [e for e in entries if isinstance(e, dict) and "id" in e]
        replica.models = tuple(str(e["id"]) for e in cards)
        # vLLM lists a LoRA adapter with its base model as `parent` (null for a base model)
        replica.adapters = {
            str(e["id"]): str(e.get("root")) for e in cards if isinstance(e.get("parent"), str)
        }
        lens = [
            e["max_model_len"]
            for e in entries
            if isinstance(e, dict) and isinstance(e.get("max_model_len"), int)
        ]
        replica.max_model_len = min(lens) if lens else None
