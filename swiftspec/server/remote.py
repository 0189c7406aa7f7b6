"""`swiftspec chat --server URL`: the chat and scripted mode on a running `swiftspec serve`, through the
same EngineAPI as an in-process Engine. Each answer is one streamed chat completion that asks for every
step's token ids and figures (the ``stream_stats`` extension), so the stats panel stays live."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx

from swiftspec.engine.config import SamplingParams
from swiftspec.engine.events import StepEvent, StepStats
from swiftspec.engine.host.failures import EngineError
from swiftspec.engine.host.protocol import EngineInfo
from swiftspec.server.api import sampling_body

CONNECT_TIMEOUT_S = 10.0
HEALTH_TIMEOUT_S = 2.0


class RemoteEngine:
    """A served engine. ``connect`` checks the server and reads its EngineInfo and sampling defaults;
    ``cancel`` (thread-safe) hangs up on the current answer, which the server then stops."""

    def __init__(self, client: httpx.Client, info: EngineInfo, defaults: SamplingParams, url: str):
        self._client, self.info, self.defaults, self.url = client, info, defaults, url
        self._response: httpx.Response | None = None
        self._cancelled = False

    @classmethod
    def connect(cls, url: str, api_key: str | None = None,
                progress: Callable[[str], None] | None = None) -> RemoteEngine:
        base = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        client = httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(CONNECT_TIMEOUT_S, read=None))
        (progress or (lambda _line: None))(f"connecting to {base}")
        try:
            described = _json(client.get("/swiftspec/v1/info"))
            info = EngineInfo.from_dict(described["engine"])
            defaults = SamplingParams(**described["defaults"]).validate()
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            client.close()
            raise EngineError(f"cannot use the server at {base}: {e}") from None
        except EngineError:
            client.close()
            raise
        return cls(client, info, defaults, base)

    def generate(self, messages: list[dict], params: SamplingParams | None = None) -> Iterator[StepEvent]:
        # Messages, never token ids: a chat completion takes messages and the server templates them, so this
        # is no TakesIds and the chat sends it a turn's messages (its count_tokens asks the server).
        params = (params or SamplingParams()).validate()
        body = sampling_body(params)
        body["swiftspec"]["stream_stats"] = True
        return self._stream({**body, "messages": messages, "stream": True})

    def _stream(self, body: dict) -> Iterator[StepEvent]:
        self._cancelled = False
        try:
            with self._client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    _json(response)
                self._response = response
                for line in response.iter_lines():
                    if self._cancelled:
                        break
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise EngineError(chunk["error"].get("message", "the server failed"))
                    step = chunk.get("swiftspec") or {}
                    if "token_ids" not in step:
                        continue
                    text = "".join(c.get("delta", {}).get("content") or "" for c in chunk["choices"])
                    reason = step["finish_reason"]
                    yield StepEvent(step["token_ids"], text, StepStats(**step["stats"]), reason is not None, reason)
                    if reason is not None:
                        return
        except httpx.HTTPError as e:
            if not self._cancelled:
                raise EngineError(f"lost the server at {self.url}: {e}") from None
        finally:
            self._response = None
        yield StepEvent([], "", StepStats(), True, "cancelled")

    def count_tokens(self, messages: list[dict]) -> int:
        try:
            return int(_json(self._client.post("/swiftspec/v1/tokenize", json={"messages": messages}))["count"])
        except httpx.HTTPError as e:
            raise EngineError(f"lost the server at {self.url}: {e}") from None

    def cancel(self) -> None:
        self._cancelled = True
        response = self._response
        if response is not None:
            try:
                response.close()
            except Exception:  # closing from another thread while it reads: the reader sees the end
                pass

    @property
    def alive(self) -> bool:
        try:
            return self._client.get("/health", timeout=HEALTH_TIMEOUT_S).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        self.cancel()
        self._client.close()

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _json(response: httpx.Response) -> dict:
    """The body of a 200; otherwise EngineError with the server's own error message."""
    try:
        body = response.json()
    except ValueError:
        body = {}
    if response.status_code != 200:
        message = (body.get("error") or {}).get("message") if isinstance(body, dict) else None
        raise EngineError(f"the server answered {response.status_code}: {message or response.text[:200]}")
    return body
