"""A scripted OpenAI-compatible judge for the tests: ``/v1/chat/completions`` on 127.0.0.1 answering each request with
``verdict(text)`` (the user message), counting requests on the server side (so "every third request hangs" is exact),
recording the most requests it held at once, and answering scripted HTTP statuses first."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def length_score(text):
    """The default script: ``Score: len(text) % 11`` (a 0-10 score that differs between completions)."""
    return f"Some reasoning.\nScore: {len(text) % 11}"


class ScriptedJudge:
    """Serves in a thread; use as a context manager. ``hang_every=k``: the k-th, 2k-th, ... request sleeps ``hang_s``
    before answering (past a client's timeout). ``statuses``: HTTP statuses of the first requests, in order (200 =
    answer normally). ``hold=n``: each request waits (up to ``hold_s``) until n are in flight, so a client that sends n
    at once is seen doing so."""

    def __init__(self, verdict=length_score, hang_every=0, hang_s=1.5, statuses=(), hold=0, hold_s=2.0, key=None):
        self.verdict, self.hang_every, self.hang_s = verdict, hang_every, hang_s
        self.statuses, self.hold, self.hold_s, self.key = list(statuses), hold, hold_s, key
        self.count = self.in_flight = self.max_in_flight = 0
        self.texts, self.auth = [], []
        self.cond = threading.Condition()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with judge.cond:
                    judge.count += 1
                    n = judge.count
                    judge.in_flight += 1
                    judge.max_in_flight = max(judge.max_in_flight, judge.in_flight)
                    judge.auth.append(self.headers.get("Authorization"))
                    judge.cond.notify_all()
                    if judge.hold:
                        judge.cond.wait_for(lambda: judge.in_flight >= judge.hold, timeout=judge.hold_s)
                try:
                    judge.answer(self, n, body)
                finally:
                    with judge.cond:
                        judge.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def answer(self, handler, n, body):
        status = self.statuses[n - 1] if n <= len(self.statuses) else 200
        if self.hang_every and n % self.hang_every == 0:
            time.sleep(self.hang_s)
        if status != 200:
            out = json.dumps({"error": {"message": "scripted failure"}}).encode()
        else:
            text = body["messages"][-1]["content"]
            with self.cond:
                self.texts.append(text)
            out = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": self.verdict(text)},
                                           "finish_reason": "stop"}]}).encode()
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(out)))
            handler.end_headers()
            handler.wfile.write(out)
        except OSError:  # the client gave up (timed out) first
            pass

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
