"""Scale-down drain: a draining worker leaves rotation but finishes every request it already has."""

import subprocess
import sys
import threading

import httpx
import openai

from tandem.launcher import ServiceProcess


def test_drain_stops_readiness_and_waits_for_requests_in_flight():
    with ServiceProcess(["worker", "--model", "smollm2", "--num-kv-blocks", "128"], name="drain-worker") as worker:
        client = openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        pieces: list[str] = []
        started = threading.Event()

        def stream():
            for chunk in client.completions.create(model="smollm2", prompt="Count: one, two,", max_tokens=48,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):
                pieces.append(chunk.choices[0].text if chunk.choices else "")
                started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        drain = subprocess.run([sys.executable, "-m", "tandem.cli", "drain", "--url", worker.url, "--timeout", "60"],
                               capture_output=True, text=True, timeout=90, env={"PYTHONSAFEPATH": "1"})
        assert drain.returncode == 0 and "is idle" in drain.stdout, drain.stdout + drain.stderr
        t.join(60)
        assert httpx.get(worker.url + "/ready").status_code == 503  # routers take it out of rotation
        assert httpx.head(worker.url + "/ready").status_code == 503
        usage = client.completions.create(model="smollm2", prompt="x", max_tokens=2)  # still answers if asked
        assert usage.choices[0].text is not None
        assert len("".join(pieces)) > 0 and len(pieces) >= 40  # the in-flight stream ran to its end
