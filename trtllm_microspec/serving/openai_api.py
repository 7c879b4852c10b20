"""`microspec serve --openai-port PORT`: the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions) in front
of the running Triton model.

Every request is forwarded to the Triton model over Triton's gRPC stream (tritonclient.grpc.aio), exactly like a
`microspec client` request, so OpenAI and Triton clients share the one engine and its running batch, the model's
queue limit, its validation and its metrics. The front only translates: it renders chat messages with the engine's
own Tokenizer (the same `apply_chat` the model uses for `chat`), so the model sees plain text; stop sequences go to
the model's `stop_words` (it ends the request there and frees its blocks); a client that goes away cancels the gRPC
call, which the model sees at its next step. Errors carry OpenAI's body, {"error": {message, type, param, code}}:
400 a bad body or parameter (the model's own checks included), 404 an unknown model or route, 413 a body over
MAX_BODY_BYTES, 429 Triton's queue is full (--max-queue-size), 503 Triton is shutting down, restarting or
unreachable, 500 a fault of the model or ours. The gRPC channel reconnects within a second of Triton coming back (a
restart after the model's process died).
"""
# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request) at run time
import asyncio
import functools
import json
import math
import socket
import threading
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Literal

from ..models.registry import UserError
from .client import FAST_RECONNECT, MAX_STOP_WORDS, MODEL_NAME, QUEUE_FULL, error_code, make_inputs

# the largest body read: far above any prompt an engine takes (the model refuses a text over max_prompt tokens of
# the longest token's bytes), and a bound on what one request costs the serve process, which parses and renders it
# on the front's event loop (a 300 MB chat body took it to 2.6 GB and held every other OpenAI request for 9 s)
MAX_BODY_BYTES = 16 << 20
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}  # OpenAI's default for completions; chat has none in OpenAI
# fields of OpenAI's API this server does not serve, and the values that ask for nothing (any other is refused)
UNSERVED = {"best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "logprobs": (None, False),
            "top_logprobs": (None, 0), "tools": (None, []), "functions": (None, []), "logit_bias": (None, {}),
            "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
            "response_format": (None, {"type": "text"})}


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def model_error(message: str, fields: set[str]) -> APIError:
    """A failed response's message -> its OpenAI status, by the class `microspec client` reads from it
    (client.error_code): Triton's own queue refusal is 429 (retry later), the rest of UNAVAILABLE (shutting down)
    503, INTERNAL 500, the others 400. A parameter the model refused is named by the message's first word."""
    code = error_code(message)
    if QUEUE_FULL in message:
        return APIError(429, message, "rate_limit_error", code="queue_full")
    if code == "UNAVAILABLE" or "unknown model" in message or "not ready" in message:
        return APIError(503, message, "server_error", code="unavailable")
    if code == "INTERNAL":
        return APIError(500, message, "server_error", code="internal_error")
    word = message.split(" ", 1)[0]
    return APIError(400, message, param=word if word in fields else None, code="invalid_value")


def _pydantic():
    try:
        from pydantic import BaseModel, ConfigDict, Field
    except ModuleNotFoundError:
        raise UserError("the OpenAI endpoint needs the serve extra: pip install fastapi uvicorn") from None
    return BaseModel, ConfigDict, Field


def request_models():
    BaseModel, ConfigDict, Field = _pydantic()

    class StreamOptions(BaseModel):
        include_usage: bool = False

    class Common(BaseModel):
        model_config = ConfigDict(extra="allow")  # what clients add beyond these is checked against UNSERVED
        model: str
        max_tokens: Annotated[int, Field(ge=1, lt=2 ** 31)] | None = None
        temperature: float = 1.0  # OpenAI's default: sampled; 0 is greedy
        top_p: float = 1.0
        top_k: Annotated[int, Field(ge=0, lt=2 ** 31)] = 0  # vLLM's extra parameter (extra_body); 0: no limit
        seed: Annotated[int, Field(ge=0, lt=2 ** 64)] | None = None
        speculate: bool = True  # ours (extra_body): false, the request decodes as AR's (SamplingParams.speculate)
        stop: str | list[str] | None = None
        n: int = 1
        stream: bool = False
        stream_options: StreamOptions | None = None

    class CompletionRequest(Common):
        prompt: str | list[str]

    class ContentPart(BaseModel):
        type: Literal["text"]
        text: str

    class Message(BaseModel):
        role: Literal["system", "user", "assistant"]
        content: str | list[ContentPart]

    class ChatRequest(Common):
        messages: Annotated[list[Message], Field(min_length=1)]
        max_completion_tokens: Annotated[int, Field(ge=1, lt=2 ** 31)] | None = None

    return CompletionRequest, ChatRequest


class Front:
    """The OpenAI endpoint as an ASGI app over the Triton model at `grpc_url`; `tokenizer` renders chat prompts."""

    def __init__(self, grpc_url: str, tokenizer, model: str = MODEL_NAME):
        self.grpc_url, self.tokenizer, self.model = grpc_url, tokenizer, model
        self.triton = None  # the aio gRPC client: made in the server's event loop
        self.created = int(time.time())

    def app(self):
        try:
            from fastapi import FastAPI, Request
            from fastapi.responses import JSONResponse
            from starlette.exceptions import HTTPException
        except ModuleNotFoundError:
            raise UserError("the OpenAI endpoint needs the serve extra: pip install fastapi uvicorn") from None
        CompletionRequest, ChatRequest = request_models()

        @asynccontextmanager
        async def lifespan(_):
            import tritonclient.grpc.aio as aio

            # reconnects within a second of Triton restarting (Supervisor), not after gRPC's growing backoff
            self.triton = aio.InferenceServerClient(self.grpc_url, channel_args=FAST_RECONNECT)
            yield
            await self.triton.close()

        app = FastAPI(title="microspec OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)

        @app.exception_handler(APIError)
        async def api_error(_, e: APIError):
            return JSONResponse(e.body(), status_code=e.status)

        @app.exception_handler(HTTPException)
        async def http_error(_, e: HTTPException):  # unknown routes (404), wrong methods (405)
            return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model, "object": "model", "created": self.created,
                                                "owned_by": "microspec"}]}

        @app.post("/v1/completions")
        @ours
        async def completions(request: Request):
            req = self.check(await parse(CompletionRequest, request))
            prompt = req.prompt
            if isinstance(prompt, list):
                if len(prompt) != 1:
                    raise APIError(400, "prompt: one prompt per request (a list of one string at most)",
                                   param="prompt")
                prompt = prompt[0]
            return await self.generate(req, prompt, "completion", request)

        @app.post("/v1/chat/completions")
        @ours
        async def chat(request: Request):
            req = self.check(await parse(ChatRequest, request))
            messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                         else "".join(p.text for p in m.content)} for m in req.messages]
            try:
                prompt = self.tokenizer.apply_chat(messages)
            except UserError as e:  # no chat template, or the template refuses these messages
                raise APIError(400, str(e), param="messages") from None
            if req.max_completion_tokens is not None:
                req.max_tokens = req.max_completion_tokens
            return await self.generate(req, prompt, "chat", request)

        return app

    def check(self, req):
        """The request, unless it names another model or asks for what this server does not do."""
        if req.model != self.model:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {self.model!r}",
                           param="model", code="model_not_found")
        if req.n != 1:
            raise APIError(400, f"n must be 1: this server returns one choice per request, got {req.n}", param="n")
        if isinstance(req.stop, list) and len(req.stop) > MAX_STOP_WORDS:
            raise APIError(400, f"stop: at most {MAX_STOP_WORDS} stop sequences per request, got {len(req.stop)}",
                           param="stop")
        body = req.model_dump()
        for name, allowed in UNSERVED.items():
            if name in body and body[name] not in allowed:
                raise APIError(400, f"{name} is not supported by this server (got {body[name]!r})", param=name,
                               code="unsupported_parameter")
        return req

    async def generate(self, req, prompt: str, kind: str, request):
        from fastapi.responses import JSONResponse, StreamingResponse

        max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_MAX_TOKENS[kind]
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        sampling = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                    **({"random_seed": req.seed} if req.seed is not None else {}),
                    **({} if req.speculate else {"speculate": False})}
        try:
            inputs = make_inputs(prompt, max_tokens, stream=req.stream, stop_words=stop, sampling=sampling)
        except OverflowError as e:  # a number the model's input types cannot hold (pydantic bounds the rest)
            raise APIError(400, str(e)) from None
        fields = set(type(req).model_fields)
        responses = self.responses(inputs, fields)
        # the first response before any header: a refusal (bad value, queue full) gets its status code; meanwhile a
        # client that goes away cancels the request
        first = await until_disconnected(request, anext(responses))
        meta = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.model}
        if not req.stream:
            out = first
            while "num_output_tokens" not in out:  # the model sends one response when not streaming; be lenient
                out = await until_disconnected(request, anext(responses))
            await responses.aclose()
            text = out["text_output"][0].decode()
            choice = {"index": 0, "finish_reason": finish_reason(out, max_tokens), "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": text}} if kind == "chat" else {"text": text})
            return JSONResponse({**meta, "object": "chat.completion" if kind == "chat" else "text_completion",
                                 "choices": [choice], "usage": usage(out), "microspec": spec_stats(out)})
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(self.events(first, responses, meta, kind, max_tokens, include_usage),
                                 media_type="text/event-stream")

    async def events(self, first: dict, responses: AsyncGenerator, meta: dict, kind: str, max_tokens: int,
                     include_usage: bool) -> AsyncGenerator[str, None]:
        """Server-sent events: a chunk per text piece, the finish chunk with the speculation statistics, a usage
        chunk when asked, then [DONE]. A client that disconnects cancels this generator (Starlette), and closing
        `responses` cancels the gRPC call."""
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(choices: list, **extra) -> str:
            return f"data: {json.dumps({**meta, 'object': obj, 'choices': choices, **extra})}\n\n"

        def choice(text: str | None, finish: str | None = None, role: bool = False) -> dict:
            if kind != "chat":
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

        try:
            if kind == "chat":
                yield chunk([choice("", role=True)])
            out = first
            while True:
                piece = out["text_output"][0].decode()
                if piece:
                    yield chunk([choice(piece)])
                if "num_output_tokens" in out:
                    break
                out = await anext(responses)
            yield chunk([choice(None, finish_reason(out, max_tokens))], microspec=spec_stats(out))
            if include_usage:
                yield chunk([], usage=usage(out))
        except APIError as e:  # after the headers: the error as an event (the openai client raises it)
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            await responses.aclose()
        yield "data: [DONE]\n\n"

    async def responses(self, inputs: list, fields: set[str]) -> AsyncGenerator[dict, None]:
        """The model's responses to one request (output name -> array) up to its last, which carries the
        statistics. Closing this generator early cancels the request on the server."""
        import grpc

        async def one_request():
            yield {"model_name": self.model, "inputs": inputs}

        call = self.triton.stream_infer(one_request())
        try:
            async for result, error in call:
                if error is not None:
                    raise model_error(error.message(), fields)
                out = {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}
                yield out
                if "num_output_tokens" in out:
                    return
            raise APIError(503, "the Triton stream ended before the request completed", "server_error",
                           code="unavailable")
        except grpc.RpcError as e:
            raise APIError(503, f"the Triton server at {self.grpc_url} is unavailable: {e.code().name}",
                           "server_error", code="unavailable") from None
        finally:
            call.cancel()


def ours(handler):
    """Any other exception in a handler is our fault: a 500 with OpenAI's body (an exception handler for Exception
    would make Starlette re-raise it after the response and drop the connection)."""
    @functools.wraps(handler)
    async def guarded(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except APIError:
            raise
        except Exception as e:
            raise APIError(500, f"{type(e).__name__}: {e}", "server_error", code="internal_error") from e

    return guarded


async def parse(model, request):
    """The JSON body as `model` (a request_models class), or a 400 naming the first bad field; 413 a body over
    MAX_BODY_BYTES (read to its end and dropped, so that the client gets the answer, not a reset connection)."""
    from pydantic import ValidationError

    body, size = bytearray(), 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= MAX_BODY_BYTES:
            body += chunk
    if size > MAX_BODY_BYTES:
        raise APIError(413, f"the body is {size} bytes: this server takes at most {MAX_BODY_BYTES} ("
                            f"{MAX_BODY_BYTES >> 20} MiB)", code="body_too_large")
    try:
        return model.model_validate_json(bytes(body))
    except ValidationError as e:
        # of a union's failed members (content: a string, or a list of text parts) the one the value went furthest
        # into says what is wrong: an image part's type, not "Input should be a valid string"
        err = max(e.errors(), key=lambda x: len(x.get("loc", ())))
        # the field's path, without pydantic's union-member steps (prompt.str, content.list[ContentPart])
        param = ".".join(str(x) for x in err.get("loc", ()) if isinstance(x, int) or
                         (x.isidentifier() and x not in ("str", "int", "float", "bool"))) or None
        if err.get("type") == "json_invalid":  # where, and why (a lone surrogate \ud800: a bad hex escape)
            raise APIError(400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', 'invalid')}") from None
        raise APIError(400, f"{param or 'body'}: {err.get('msg', 'invalid')}", param=param) from None


async def until_disconnected(request, awaitable):
    """Awaits `awaitable`, unless the HTTP client disconnects first: then it is cancelled (closing the gRPC call
    and so the request on the model)."""
    work = asyncio.ensure_future(awaitable)

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not work.done():
        work.cancel()
        raise APIError(499, "the client disconnected")  # nobody reads it; ends the handler
    return work.result()


def finish_reason(out: dict, max_tokens: int) -> str:
    """"length" when the request used its whole budget, else "stop" (end of sequence or a stop sequence)."""
    return "length" if int(out["num_output_tokens"][0]) >= max_tokens else "stop"


def usage(out: dict) -> dict:
    p, c = int(out["num_input_tokens"][0]), int(out["num_output_tokens"][0])
    # OpenAI's field for the prompt tokens a provider's prompt cache held (here: the prefix cache's)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": int(out["num_cached_tokens"][0])}}


def spec_stats(out: dict) -> dict:
    """The model's NaN (no speculative round ran: AR, or every step plain) is JSON's null."""
    def num(v) -> float | None:
        v = float(v[0])
        return None if math.isnan(v) else v
    return {"acceptance_length": num(out["acceptance_length"]), "mean_active_vocab": num(out["mean_active_vocab"])}


def engine_dir_of(grpc_url: str, model: str = MODEL_NAME) -> Path:
    """The engine directory the running Triton model serves (its config.pbtxt parameter)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        params = client.get_model_config(model, as_json=True)["config"].get("parameters", {})
    finally:
        client.close()
    return Path(params["engine_dir"]["string_value"])


class OpenAIFront:
    """`serve --openai-port`: uvicorn on a thread of the serve process. The port is bound when this is made (a busy
    port fails at once, before the model loads); `start` begins serving once Triton is ready; leaving stops it."""

    def __init__(self, host: str, port: int):
        try:
            import uvicorn  # noqa: F401
        except ModuleNotFoundError:
            raise UserError("the OpenAI endpoint needs the serve extra: pip install fastapi uvicorn") from None
        self.host, self.port = host, port
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError:
            self.sock.close()
            raise UserError(f"port {port} on {host} is in use (another server?): choose another --openai-port") \
                from None
        self.server, self.thread = None, None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, grpc_url: str, tokenizer=None) -> "OpenAIFront":
        import uvicorn

        from ..models.tokenizer import Tokenizer

        tokenizer = tokenizer or Tokenizer(engine_dir_of(grpc_url))
        config = uvicorn.Config(Front(grpc_url, tokenizer).app(), log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="microspec-openai", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise UserError(f"the OpenAI endpoint on {self.host}:{self.port} did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.thread.join(10)
        self.sock.close()

    def __enter__(self) -> "OpenAIFront":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

