"""Waiting until a started server answers."""

import http.server
import threading
from collections.abc import Iterator

import pytest

from kvtier.core.errors import KvtierError
from kvtier.net.readiness import wait_ready


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def answering_url() -> Iterator[str]:
    """The URL of a server that answers 200 to everything."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/health"
    finally:
        server.shutdown()
        server.server_close()


def test_ready_when_the_server_answers_200_and_its_process_lives(answering_url: str) -> None:
    wait_ready(answering_url, 5, exited=lambda: None, interval_s=0.05)


def test_a_200_is_not_the_servers_own_when_its_process_exited_meanwhile(
    answering_url: str,
) -> None:
    codes = iter([None])  # alive before the request, exited (code 1) after it

    with pytest.raises(KvtierError, match="the router: exited with code 1 while starting"):
        wait_ready(answering_url, 5, exited=lambda: next(codes, 1), what="the router")


def test_a_server_that_never_answers_times_out() -> None:
    with pytest.raises(KvtierError, match="not ready after"):
        wait_ready("http://127.0.0.1:1/health", 0.2, interval_s=0.05)
