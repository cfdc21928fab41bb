"""The HTTP routes (Starlette): OpenAI's completions, chat completions and models, plus health and metrics.

A request is parsed (protocol.py), checked by the runtime's request validation, then handed to the
scheduler, which decodes it in a worker thread. Every refusal is an OpenAI-shaped error: 400 for a bad
body or value, 401 without the API key (--api-key), 404 for another model, 413 for a body longer than any
request that fits the context, 429 when the queue is full, 503 while shutting down or when no slot freed up
in time, 504 when decoding ran past the timeout, 500 for a bug (logged with its traceback) or for an engine
call the device failed (e.g. out of memory; logged in one line).
"""

from __future__ import annotations

import asyncio
import fcntl
import hmac
import json
import logging
import math
import os
import struct
import termios
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import TypeVar

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Match, Route

from ..errors import BundleError, DeviceError, RequestError
from ..decode import encode_ids
from ..logprobs import TokenLogprobs
from ..manifest import TOKENIZER_DIR, read_tokenizer_config, runtime_version
from ..validation import Request, prompt_token_ids
from . import protocol
from .chat import ChatRequestError, SuppliedTemplate, load_chat_template
from .metrics import Metrics
from .protocol import CHAT, COMPLETIONS, ApiError, Logprobs, Reply, sse
from .scheduler import Job, Overloaded, Scheduler, Stopped, Unavailable, unless
from .tools import tool_parser

log = logging.getLogger("specbuild.serve")
T = TypeVar("T")
RETRY_AFTER = {"Retry-After": "1"}  # seconds; a slot frees up within one request's decoding time
# The openai client (and other Stainless-made clients) resend a 5xx twice unless told not to by this header.
NO_RETRY = {"x-should-retry": "false"}
# nginx, docs/serving.md's proxy for untrusted networks, buffers a proxied response by default: a stream's events would
# reach the client kilobytes at a time, or at its end. This header turns that off for the response alone.
UNBUFFERED = {"X-Accel-Buffering": "no"}
# A body may hold this many bytes per token of context (and a little for the rest): far more than any text
# or token-id list that fits (a token is rarely over 16 characters; JSON escapes one in at most 12 bytes),
# yet small enough that reading, parsing and tokenizing a body cannot stall the server.
BODY_BYTES_PER_TOKEN, BODY_BYTES_BASE = 64, 64 * 1024


@dataclass(frozen=True)
class Settings:
    model: str  # the name clients pass as "model"
    max_queue: int = 64  # requests waiting for a slot before new ones get 429
    timeout: float | None = 600.0  # seconds from arrival to the last token; None: no limit
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    max_connections: int = 1024  # open connections at once; more get 503 (_refusing_beyond)
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on /v1 routes; None: open
    # where requests that omit temperature/top_p/top_k/min_p/repetition_penalty get them (protocol.sampling_defaults)
    generation_config: str = "auto"
    allowed_origins: tuple[str, ...] = ()  # origins whose web pages may call the API from a browser (CORS); "*": any
    chat_template: SuppliedTemplate | None = None  # rendered in place of the bundle's (--chat-template)
    tool_call_parser: str | None = None  # how chat replies' tool calls are parsed (--tool-call-parser); None: not
    tokenizer_info: bool = False  # GET /tokenizer_info answers (--enable-tokenizer-info-endpoint, off as in vLLM)


class Server:
    """The app's state: one decoder (its slots shared by all requests), the chat template, the scheduler."""

    def __init__(self, decoder, settings: Settings):
        self.decoder = decoder
        self.settings = settings
        # /v1/models' "created" (vLLM gives a timestamp too): a bundle records no build time, and 0 read as 1970
        self.created = int(time.time())
        self.chat_template = load_chat_template(decoder.root / TOKENIZER_DIR, settings.chat_template)
        self.defaults = protocol.sampling_defaults(decoder.manifest.generation_config, settings.generation_config,
                                                   decoder.has_min_p, decoder.has_penalties)
        self.tool_parser = tool_parser(settings.tool_call_parser, decoder.tokenizer) if settings.tool_call_parser else None
        self.metrics = Metrics(decoder.slots.size)
        self.scheduler = Scheduler(decoder, settings.max_queue, settings.timeout, self.metrics)
        # Builds whole responses and streams' echoed prompts (see _off_loop), one at a time as the loop did; not on the
        # scheduler's checking thread, where a response would wait for the checks of long prompts queued before it.
        self._builder = ThreadPoolExecutor(1, thread_name_prefix="specbuild-respond")
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models),
                Route("/v1/models/{model:path}", self.model),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/tokenizer_info", self.tokenizer_info),
                Route("/health", self.health),
                Route("/version", self.version),
                Route("/metrics", self.metrics_page),
            ],
            # Starlette types every handler as taking any Exception, though it calls each with its own class's
            exception_handlers={HTTPException: _http_error, Exception: _internal_error},  # type: ignore[dict-item]
            lifespan=self._lifespan,
            middleware=self._middleware(),
        )

    def _middleware(self) -> list[Middleware]:
        middleware = []
        if self.settings.allowed_origins:  # outside the key check: a preflight carries no key, and a page reads a 401
            # Any request header: the openai JS client sends Authorization and its own x-stainless-* ones. Retry-After
            # and x-should-retry exposed, or a page's openai client could not see them and would resend a 504 twice.
            middleware.append(Middleware(Cors, allow_origins=self.settings.allowed_origins,
                                         allow_methods=("GET", "POST"), allow_headers=("*",),
                                         expose_headers=(*RETRY_AFTER, *NO_RETRY)))
        if self.settings.api_key:
            middleware.append(Middleware(RequireApiKey, key=self.settings.api_key))
        return middleware

    def http_server(self, host: str, port: int, log_level: str = "info") -> Uvicorn:
        """uvicorn serving this app until SIGTERM/SIGINT (or `should_exit`), then draining (see Uvicorn)."""
        config = uvicorn.Config(self.app, host=host, port=port, log_level=log_level,
                                http=_refusing_beyond(AutoHTTPProtocol, self.settings.max_connections,
                                                      self.metrics.refused_connections.inc),
                                # no WebSocket routes: with `websockets` installed (uvicorn[standard]) an upgrade got an
                                # empty text/plain 403 from uvicorn, where a plain request gets the JSON 404
                                ws="none",
                                # None, as uvicorn's default: its limit also counted the tasks of requests whose
                                # client had gone, and refused new ones in text/plain, counted nowhere, while those
                                # reached it. _refusing_beyond bounds the connections, one request each at a time, and
                                # every handler stops once its client leaves (_unless_gone, and Starlette's streams)
                                limit_concurrency=None,
                                # a backstop: drain cuts first (uvicorn takes whole seconds)
                                timeout_graceful_shutdown=math.ceil(self.settings.shutdown_timeout) + 5,
                                # https://no-color.org, as the CLI reads it: uvicorn colours wherever stdout is a terminal
                                use_colors=False if os.environ.get("NO_COLOR") else None)
        return Uvicorn(config, self.scheduler, self.settings.shutdown_timeout)

    @asynccontextmanager
    async def _lifespan(self, app):
        yield
        await self.scheduler.close()

    async def completions(self, request: HttpRequest) -> Response:
        return await self._generate(COMPLETIONS, request)

    async def chat_completions(self, request: HttpRequest) -> Response:
        return await self._generate(CHAT, request)

    async def models(self, request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: HttpRequest) -> Response:
        name = request.path_params["model"]
        if name != self.settings.model:
            return JSONResponse(protocol.unknown_model(name, self.settings.model).body(), 404)
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.settings.model, "object": "model", "created": self.created, "owned_by": "specbuild",
                "max_model_len": self.decoder.max_seq_len}

    async def tokenize(self, http: HttpRequest) -> Response:
        """vLLM's /tokenize: a prompt's or a chat's token ids, as a completion or chat completion would decode them."""
        try:
            request = protocol.parse_tokenize(await self._body_unless_cut(http), self.settings.model)
            tokens = await _unless_gone(http, self.scheduler.run_check(partial(self._tokens, request)))
        except Exception as exc:
            return self._refuse(TOKENIZE, exc)

        # a 1M-character prompt's token_strs and JSON stalled every stream 0.6-1.0 s on the loop
        def build(halt: Callable[[], None]) -> Json:
            # halted between lookups too, which take twice the JSON's time (0.48 s and 0.23 s: 291k tokens, 152k vocabulary)
            strings = ([self.decoder.tokenizer.id_to_token(token) for token in protocol.halting(tokens, halt)]
                       if request.token_strs else None)
            return Json({"count": len(tokens), "max_model_len": self.decoder.max_seq_len, "tokens": tokens,
                         "token_strs": strings}, halt=halt)
        try:
            built = await self._off_loop(build, http)
        except Exception as exc:  # its client gone, or a bug: answered and counted here, the connection kept
            return self._refuse(TOKENIZE, exc)
        self.metrics.outcome(TOKENIZE, "ok")
        return built

    def _tokens(self, request: protocol.Tokenize) -> list[int]:
        if request.prompt is not None:
            return encode_ids(self.decoder.tokenizer, request.prompt, request.add_special_tokens)
        if self.chat_template is None:
            raise ApiError(400, "this model's bundle has no chat template (its tokenizer has none), and the server was "
                                "started without --chat-template: tokenize a prompt instead", "messages")
        try:
            text = self.chat_template.render(request.messages, **request.chat)
        except RequestError as exc:
            raise ApiError(400, str(exc), exc.param if isinstance(exc, ChatRequestError) else "messages") from None
        return encode_ids(self.decoder.tokenizer, text, request.add_special_tokens)

    async def detokenize(self, http: HttpRequest) -> Response:
        """vLLM's /detokenize: the text of token ids, special tokens as written (as an echoed prompt's)."""
        try:
            tokens = protocol.parse_detokenize(await self._body_unless_cut(http), self.settings.model,
                                               self.decoder.vocab_size)
            text = await _unless_gone(http, self.scheduler.run_check(partial(self.decoder.tokenizer.decode, tokens,
                                                                             skip_special_tokens=False)))
        except Exception as exc:
            return self._refuse(DETOKENIZE, exc)
        self.metrics.outcome(DETOKENIZE, "ok")
        return JSONResponse({"prompt": text})

    async def tokenizer_info(self, request: HttpRequest) -> Response:
        """vLLM's /tokenizer_info: the bundle's tokenizer_config.json, special tokens as their text, with the chat
        template the server renders; lm-evaluation-harness's remote tokenizer reads its special tokens there."""
        if not self.settings.tokenizer_info:  # vLLM's default too: the template may be the operator's own
            return JSONResponse(ApiError(404, "GET /tokenizer_info is off: start the server with "
                                              "--enable-tokenizer-info-endpoint, as vLLM's").body(), 404)
        config = read_tokenizer_config(self.decoder.root / TOKENIZER_DIR)
        info = {name: _token_texts(value) for name, value in config.items() if name not in ("vocab_file", "merges_file")}
        info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        if self.chat_template is not None:
            info["chat_template"] = self.chat_template.source
        return JSONResponse(info)

    async def health(self, request: HttpRequest) -> Response:
        if self.scheduler.draining:
            return JSONResponse({"status": "shutting down"}, 503)
        return JSONResponse({"status": "ok"})

    async def version(self, request: HttpRequest) -> Response:
        """vLLM's GET /version: the runtime's, which decides what a bundle's engines are asked and answer."""
        return JSONResponse({"version": runtime_version()})

    async def metrics_page(self, request: HttpRequest) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def _generate(self, endpoint: str, http: HttpRequest) -> Response:
        jobs: list[Job] = []
        try:
            request = protocol.parse(endpoint, await self._body_unless_cut(http), self.settings.model, self.defaults,
                                     self.settings.tool_call_parser)
            # counted before the choices are built: an n of millions would take the event loop seconds and GBs
            prompts = len(request.batch or [request.prompt])
            if prompts * request.n > self.scheduler.parallel + self.settings.max_queue:  # else a 429 however long
                asked = (f"the request asks for {prompts * request.n} choices (n {request.n} for each of {prompts} "
                         "prompts)" if request.n > 1 else f"prompt holds {prompts} prompts")
                raise ApiError(400, f"{asked}, more than this server takes at once (--parallel + "
                                    f"--max-queue: {self.scheduler.parallel + self.settings.max_queue}); send fewer a "
                                    "request", "n" if request.n > 1 else "prompt")
            requests, submitted = request.choices(), []
            for index, one in enumerate(requests):  # each checked and queued as a request of its own
                if index % request.n:
                    one = _after_first(one, jobs[index - index % request.n])
                submitted.append(one)
                try:
                    jobs.append(await self._submitted_unless_gone(http, one))
                except ApiError as error:
                    # counted from 1, as verify and bench count prompts (a reader takes "1 of 2" for the first),
                    # with its index in the list of prompts
                    if request.batch and error.param == "prompt":
                        prompt = index // request.n
                        error.message = f"prompt {prompt + 1} of {len(request.batch)} (index {prompt}): {error.message}"
                    raise
        except Exception as exc:  # a bug among them is answered (500, logged, counted) here, where the connection
            self._stop(jobs)      # stays usable (Starlette's last handler closes it); a batch's prompts queued before
            return self._refuse(endpoint, exc)  # the one refused stop
        logprobs = "logprobs" in request.decoding
        texts = Logprobs(endpoint, self.decoder.tokenizer)  # one for both: it decodes each token's text once
        reply = Reply(endpoint, self.settings.model,
                      request.forced_calls or (self.tool_parser if request.parse_tools else None),
                      request.parallel_tool_calls, texts if logprobs else None, request.return_token_ids,
                      texts if request.prompt_logprobs else None)
        # A job stopped while it waited for its check (--timeout, the drain's cut) has no request, and no echo: its
        # iteration raises the Stopped that answers it.
        # a prompt's choices share the logprobs its first choice scored
        scores = [asyncio.get_running_loop().create_future() if logprobs or request.prompt_logprobs else None
                  for _ in requests[::request.n]]
        # vLLM echoes no text under return_token_ids (the prompt's ids are there), its logprobs all the same
        echoes = [Echo("" if request.return_token_ids else self._prompt_text(one, job.request.prompt_ids),
                       job.request.prompt_ids[:1],
                       "prompt_logprobs" in sent.decoding, scores[index // request.n])
                  if request.echo and job.request else None
                  for index, (one, sent, job) in enumerate(zip(requests, submitted, jobs))]
        if request.stream:
            return self._stream(endpoint, http, jobs, reply, request.include_usage, echoes, request.n,
                                request.continuous_usage)
        try:
            answers = await self._collect(jobs, http, logprobs, echoes)
        except Stopped as stop:
            return self._refuse(endpoint, stop, any(job.started for job in jobs))
        except Exception as exc:
            return self._refuse(endpoint, exc)
        finally:  # a no-op for those that finished; else the client left, or a batch's other prompt failed
            self._stop(jobs)
            for score in scores:  # a choice still waiting for its prompt's logprobs, whose scoring failed, ends
                if score is not None:
                    score.cancel()
        top = request.decoding.get("logprobs")

        def build(halt: Callable[[], None]) -> Json:
            answered = []
            for index, ((text, shown, records, _), job, echo) in enumerate(zip(answers, jobs, echoes)):
                assert job.request is not None  # collected: checked (a job stopped before its check raised in _collect)
                # vLLM keeps the first N + 1 of a prompt token's entries, itself first then the most probable others:
                # where it is among the N most probable, a prompt_logprobs over N shows its N + 1st too
                shown = [replace(record, top=[pair for pair in record.top if pair[0] != record.token_id][:top])
                         for record in shown or ()]
                answered.append(protocol.Answer(echo.text + text if echo else text, job.stats, [*shown, *records],
                                                echo.first if echo else (), job.token_ids, job.request.prompt_ids,
                                                # a prompt's choices after the first have the logprobs it scored
                                                answers[index - index % request.n][3]))
            return Json(reply.batch(answered, request.n, halt), halt=halt)
        try:
            built = await self._off_loop(build, http)
        except Exception as exc:  # its client gone, or a bug (a tool parser's, reading the reply): answered and
            return self._refuse(endpoint, exc, started=True)  # counted here, the connection kept
        self.metrics.outcome(endpoint, "ok")
        return built

    async def _off_loop(self, build: Callable[[Callable[[], None]], T], http: HttpRequest | None = None) -> T:
        """build(halt) in the builder's thread: a response's logprobs are a token text decoded for each of a prompt's
        tokens and its N most probable, then megabytes of JSON (0.5-1.0 s for 4000 tokens at prompt_logprobs 20, a 152k
        vocabulary, 2 loaded cores), which on the event loop stalled every other stream meanwhile. Raises
        Stopped("cancelled") if the client (`http`'s) leaves first, Stopped("shutdown") if the grace period after
        SIGTERM ends first; a stream's client leaving cancels this call. Either way a build not begun never runs, and
        one running stops at its next halt(), which raises: it ran to its end (~0.1 s for a 1000-token prompt's echo at
        logprobs 20), every response after it waiting for the one thread, and one still running at uvicorn's backstop
        (--shutdown-timeout + 5 s) was cancelled there: a text/plain 500, counted under no outcome."""
        gone = threading.Event()

        def halt() -> None:
            if gone.is_set():
                raise Stopped("cancelled")

        building = asyncio.get_running_loop().run_in_executor(self._builder, build, halt)
        cut = self.scheduler.until_cut()
        waiting: set[asyncio.Future] = {building, cut}
        if http is not None:
            waiting.add(asyncio.ensure_future(_disconnected(http)))
        try:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler is cancelled
            for each in waiting - {building}:
                each.cancel()
            if not building.done():
                gone.set()
                building.cancel()
        if building not in done:
            raise Stopped("shutdown" if cut in done else "cancelled")
        return building.result()

    def _stop(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.scheduler.stop(job, "cancelled")

    def _prompt_text(self, request: protocol.Request, ids: list[int]) -> str:
        """The text an echo begins with: the prompt as sent, or its token ids decoded (vLLM's)."""
        return request.prompt if isinstance(request.prompt, str) else self.decoder.tokenizer.decode(ids, skip_special_tokens=False)

    async def _body_unless_cut(self, http: HttpRequest) -> bytes:
        """The request body, or Stopped("shutdown") once the grace period after SIGTERM ends before it has arrived: the
        drain stops jobs, and a client still sending its body (a slow upload) held the shutdown until uvicorn's backstop
        (--shutdown-timeout + 5 s), which cancelled the request as a 500 with a logged traceback."""
        return await self.scheduler.unless_cut(self._body(http))

    async def _submitted_unless_gone(self, http: HttpRequest, request: protocol.Request) -> Job:
        """The request's job, submitted once checked, or Stopped("cancelled") if its client leaves first. Tokenizing
        (and rendering a chat) costs up to seconds for the longest bodies: the scheduler does it on its checking
        thread, one request at a time, each holding a place in its queue meanwhile. One whose client left kept that
        place until its turn, then was checked all the same, every request behind it waiting."""
        return await _unless_gone(http, self.scheduler.submit(partial(self._checked, request)))

    async def _body(self, http: HttpRequest) -> bytes:
        """The request body, refused (413) once it is longer than any request that fits the context."""
        limit = BODY_BYTES_BASE + BODY_BYTES_PER_TOKEN * self.decoder.max_seq_len
        too_long = ApiError(413, f"the request body is over {limit} bytes, more than a request that fits this "
                                 f"bundle's context of {self.decoder.max_seq_len} tokens can need; send a shorter prompt")
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_long
        chunks, size = [], 0
        try:
            async for chunk in http.stream():
                size += len(chunk)
                if size > limit:
                    raise too_long
                chunks.append(chunk)
        except ClientDisconnect:  # the client left before its body arrived: cancelled, not a server error
            raise Stopped("cancelled") from None
        return b"".join(chunks)

    def _checked(self, request: protocol.Request) -> Request:
        """The request checked by the runtime's validation (a RequestError names what is wrong) before it may
        take a place in the queue."""
        decoder = self.decoder
        prompt = request.prompt
        if prompt is None:  # a chat's first choice (a choice after the first carries its ids: _after_first)
            if self.chat_template is None:
                raise ApiError(400, "this model's bundle has no chat template (its tokenizer has none), and the server "
                                    "was started without --chat-template: use /v1/completions with a prompt", "messages")
            # refused before tokenizing as decoder.request refuses a text prompt (without max_tokens: 1, as below)
            fits = decoder.fits(request.max_tokens or 1)
            try:
                prompt = self.chat_template.prompt_ids(decoder.tokenizer, request.messages, fits,
                                                       request.add_special_tokens, **request.chat)
            except RequestError as exc:  # the rest (a message's shape, the template's refusal, its text) are the messages'
                raise ApiError(400, str(exc), exc.param if isinstance(exc, ChatRequestError) else "messages") from None
        elif isinstance(prompt, str):  # tokenized here, for the room its max_tokens needs (below)
            try:  # checked (valid UTF-8, not too long to tokenize) as decoder.request checks a text prompt
                prompt = prompt_token_ids(prompt, partial(encode_ids, decoder.tokenizer,
                                                          add_special_tokens=request.add_special_tokens),
                                          decoder.vocab_size, decoder.fits(request.max_tokens or 1))
            except RequestError as exc:
                raise protocol.invalid(exc) from None
        max_tokens = request.max_tokens
        if max_tokens is None:  # until the context is full (the last token needs no room in the cache)
            max_tokens = max(1, decoder.max_seq_len - len(prompt) + 1)
        elif len(prompt) <= decoder.max_seq_len:  # else the runtime's refusals say why
            check_room(len(prompt), max_tokens, decoder.max_seq_len)
        try:
            checked = decoder.request(prompt, max_tokens, **request.decoding)
        except RequestError as exc:
            error = protocol.invalid(exc)
            if request.endpoint == CHAT and error.param == "prompt":  # a chat sends no prompt: its messages made it
                error.param = "messages"
            raise error from None
        # a format whose tags are special tokens (Mistral's) is read from a text that keeps them, as vLLM reads it
        tags_special = request.parse_tools and self.tool_parser is not None and self.tool_parser.special_tokens
        return replace(checked, special_tokens=True) if tags_special else checked

    async def _collect(self, jobs: list[Job], http: HttpRequest, logprobs: bool, echoes: list[Echo | None]) -> list:
        """Each job's whole text, (logprobs) an echo's prompt tokens' TokenLogprobs as scored (cut to the request's
        logprobs where the response is built) and its tokens', and its prompt's TokenLogprobs where it scored them
        (vLLM's prompt_logprobs, or echo's), else None; or Stopped("cancelled") if the client disconnects first."""
        async def join(job, echo) -> tuple[str, Sequence[TokenLogprobs] | None, list, Sequence[TokenLogprobs] | None]:
            items = aiter(job)
            scored = await echo.prompt_logprobs(items) if echo else None
            # the job's first item where it scored its prompt (a choice after its prompt's first has not)
            prompt = (await anext(items))[1] if not echo and job.request and job.request.prompt_logprobs is not None else scored
            items = [item async for item in items]
            if not logprobs:
                return "".join(items), None, [], prompt
            return ("".join(delta for delta, _ in items), scored, [record for _, records in items for record in records],
                    prompt)

        collecting = asyncio.ensure_future(asyncio.gather(*map(join, jobs, echoes)))
        leaving = asyncio.ensure_future(_disconnected(http))
        try:
            await asyncio.wait({collecting, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler is cancelled
            leaving.cancel()
            if not collecting.done():  # the caller stops the jobs
                collecting.cancel()
                # a cancelled gather ends with the CancelledError as its exception, logged with a traceback unless read
                collecting.add_done_callback(lambda gathered: gathered.cancelled() or gathered.exception())
        if not collecting.done():
            raise Stopped("cancelled")
        return collecting.result()

    def _stream(self, endpoint: str, http: HttpRequest, jobs: list[Job], reply: Reply, include_usage: bool,
                echoes: list[Echo | None], n: int = 1, continuous_usage: bool = False) -> EventStream:
        """The server-sent events of a streamed reply, its choices' chunks (a batch's prompts', n choices of each)
        interleaved as they come, each naming its index (vLLM's); echoes: each job's. However the
        response ends, EventStream then stops the jobs (a no-op once they finished; else each slot is freed after at
        most one delta) and counts its outcome: also when the events never started, the client gone before the
        response's first send."""
        outcome = "cancelled"  # unless the events get to their end

        async def events():
            nonlocal outcome
            try:
                choices = [self._choice_events(endpoint, job, reply.choice(index), echo, continuous_usage)
                           for index, (job, echo) in enumerate(zip(jobs, echoes))]
                async with aclosing(_interleaved(choices)) as chunks:  # closed here: its pumps cancelled with it
                    async for event in chunks:
                        yield event
                if include_usage:
                    yield sse(reply.usage_chunk(*(job.stats for job in jobs), n=n))
                # uvicorn's send drops what comes after a connection closed, without a word: events queued by then
                # reached this line as if sent
                outcome = "cancelled" if await http.is_disconnected() else "ok"
            except Stopped as stop:  # headers are sent: the error travels as an event, as vLLM sends it
                outcome = stop.reason
                yield sse(_stopped_error(stop, any(job.started for job in jobs)).body())
            except Exception as exc:  # a 500, or a 400 for a grammar past llguidance's limits mid-decoding (grammar.Guide)
                error = _as_api_error(exc)
                outcome = OUTCOMES.get(error.status, "error")
                yield sse(error.body())
            yield sse("[DONE]")

        def ended() -> None:
            self._stop(jobs)
            # After the cut, a stream cut short was most likely closed by the server (Uvicorn._close_unread: a client
            # that stopped reading) once its jobs had finished (or their Stopped says shutdown): no client that left
            self.metrics.outcome(endpoint, "shutdown" if outcome == "cancelled" and self.scheduler.cut else outcome)

        return EventStream(events(), ended)

    async def _choice_events(self, endpoint: str, job: Job, reply: Reply, echo: Echo | None, continuous_usage: bool = False):
        """The events of one choice, to its closing chunk; raises Stopped, or the decoder's error. continuous_usage:
        each chunk carries the usage of the choice so far (stream_options.continuous_usage_stats, vLLM's)."""
        prompt_ids = job.request.prompt_ids if job.request else []
        seen = 0  # the job's items read so far
        ids_sent, first = 0, True

        def event(chunk: dict | None, last: bool = False, encode: Callable[..., str] = json.dumps) -> bytes | None:
            """The chunk's event, with the usage and the token ids of the tokens whose text has been read (the last
            chunk: every token), as vLLM counts those it has sent; encoded by `encode` (see sse)."""
            nonlocal ids_sent, first
            if chunk is None:
                return None
            read = len(job.token_ids) if last else job.decoded[seen - 1] if seen else 0
            if continuous_usage:
                prompt = len(prompt_ids)
                chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": read, "total_tokens": prompt + read}
            chunk = reply.traced(chunk, job.token_ids[ids_sent:read], prompt_ids if first else None)
            ids_sent, first = read, False
            return sse(chunk, encode)

        if endpoint == CHAT:
            yield event(reply.chunk(first=True))
        items = aiter(job)
        if echo:  # the prompt in a chunk of its own (vLLM's also holds the first token's text)
            records = await echo.prompt_logprobs(items) or ()
            seen += echo.scored  # the job's first item, read there
            yield await self._off_loop(lambda halt: event(reply.chunk(echo.text, records=records, unscored=echo.first,
                                                                      halt=halt), encode=partial(protocol.dumps, halt=halt)))
        # With logprobs a job yields (delta, its tokens' records) after every token: records whose text is
        # held back (a possible stop string, a tool call) go with the next chunk that has text or calls, or the last.
        held: list[TokenLogprobs] = []
        async for item in items:
            seen += 1
            delta, records = item if reply.logprobs else (item, ())
            held += records
            calls: list[dict] = []
            if delta and reply.tool_stream is not None:
                delta, calls = reply.tool_stream.feed(delta)
            if delta:
                yield event(reply.chunk(delta, records=held))
                held = []
            if calls and (chunk := event(reply.tool_calls_chunk(calls, held))):
                yield chunk
                held = []
        if reply.tool_stream is not None:
            rest, calls = reply.tool_stream.end()
            if rest:
                yield event(reply.chunk(rest, records=held))
                held = []
            if calls and (chunk := event(reply.tool_calls_chunk(calls, held))):
                yield chunk
                held = []
        yield event(reply.chunk(stats=job.stats, called=reply.calls_sent > 0, records=held), last=True)

    def _refuse(self, endpoint: str, exc: Exception, started: bool = False) -> Response:
        if isinstance(exc, Stopped):
            error = _stopped_error(exc, started)
            self.metrics.outcome(endpoint, exc.reason)
            if exc.reason == "cancelled":
                return Unread(error.body(), error.status)
        else:
            error = _as_api_error(exc)
            self.metrics.outcome(endpoint, OUTCOMES.get(error.status, "error"))
        return JSONResponse(error.body(), error.status, headers=error.headers)


@dataclass(frozen=True)
class Echo:
    """A completion's echoed prompt: its text, its first token (which has no logprob), whether the job's first item
    is ("", the TokenLogprobs of its other tokens) (runtime's stream_request with prompt_logprobs), and where those
    records go to the prompt's other choices, which do not score it again (None: no logprobs asked for)."""

    text: str
    first: list[int]
    scored: bool
    shared: asyncio.Future | None = None

    async def prompt_logprobs(self, items) -> Sequence[TokenLogprobs] | None:
        """The prompt's TokenLogprobs: the job's first item where it scored them, else those of the choice that did;
        None where neither logprobs nor prompt_logprobs are asked for. items: the job's, iterated."""
        if self.scored:
            _, records = await anext(items)
            if self.shared is not None and not self.shared.done():
                self.shared.set_result(records)
            return records
        return await self.shared if self.shared is not None else None


def check_room(prompt_tokens: int, max_tokens: int, max_seq_len: int) -> None:
    """vLLM's 400 (its OpenAI server's TokenizeParams) for max_tokens past the context's room, in its words, which
    clients read (the prompt to shorten), before the grammar is compiled. The room: the context and one more token,
    which needs no place in the cache. The runtime's API, as vLLM's LLM class, decodes to the context instead."""
    if max_tokens <= max_seq_len and prompt_tokens + max_tokens <= max_seq_len + 1:
        return
    if max_tokens > max_seq_len:
        raise ApiError(400, f"max_tokens={max_tokens} cannot be greater than max_model_len={max_seq_len}. "
                            "Please request fewer output tokens.", "max_tokens")
    raise ApiError(400, f"You passed {prompt_tokens} input tokens and requested {max_tokens} output tokens. However, "
                        f"the model's context length is only {max_seq_len} tokens, resulting in a maximum input length "
                        f"of {max_seq_len + 1 - max_tokens} tokens. Please reduce the length of the input prompt.",
                   "input_tokens")


def _after_first(choice: protocol.Request, first: Job) -> protocol.Request:
    """A prompt's choice after its first, given that one's job: its prompt as the first's token ids, so it is not
    rendered and tokenized again, and its prompt's logprobs the first's (Echo.shared), not scored again, unless
    max_tokens 0 asks for nothing else; its grammar the first's, not compiled again (~0.1 s a MB of schema)."""
    if first.request is None:  # stopped before its check, as this request is now
        return choice
    decoding = choice.decoding if choice.max_tokens == 0 else {
        name: value for name, value in choice.decoding.items() if name != "prompt_logprobs"}
    if first.request.structured is not None:
        decoding = {**decoding, "structured_outputs": first.request.structured}
    return replace(choice, prompt=first.request.prompt_ids, decoding=decoding)


class Cors(CORSMiddleware):
    """Starlette's CORS, whose refusal of a preflight (an origin, method or private-network request not allowed) is
    a text/plain 400: the same refusal, with the same CORS headers, OpenAI-shaped as every other error."""

    def preflight_response(self, request_headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        refused = bytes(response.body).decode().removeprefix("Disallowed CORS ")
        error = ApiError(400, f"the CORS preflight is refused ({refused} not allowed): the server's --allowed-origins "
                              "names the pages that may call it, with GET or POST")
        headers = {name: value for name, value in response.headers.items() if name not in ("content-length", "content-type")}
        return JSONResponse(error.body(), 400, headers=headers)


class RequireApiKey:
    """401 for a /v1 or tokenizer request without "Authorization: Bearer KEY", as vLLM's --api-key answers a /v1 one;
    /health and /metrics stay open to probes and scrapers. vLLM leaves /tokenize open, whose work (rendering a chat,
    tokenizing up to a body's limit) takes the checking thread every request waits for."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] in TOKENIZER_PATHS):
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            scheme, _, token = given.partition(b" ")
            # The scheme in any case (RFC 6750); the key in constant time: none guessed byte by byte.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(b" "), self.expected):
                error = ApiError(401, "a valid API key is required: send the header 'Authorization: Bearer KEY' "
                                      "(the openai client's api_key)")
                await JSONResponse(error.body(), 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


TOKENIZE, DETOKENIZE = "tokenize", "detokenize"  # the endpoints' names in the metrics
TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")
OUTCOMES = {400: "invalid", 404: "invalid", 413: "invalid", 429: "rejected", 503: "shutdown"}


def _as_api_error(exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestError):
        return protocol.invalid(exc)
    if isinstance(exc, Overloaded):
        return ApiError(429, f"the server is busy: {exc}; retry shortly", headers=RETRY_AFTER)
    if isinstance(exc, Unavailable):
        return ApiError(503, str(exc), headers=RETRY_AFTER)
    # The device's failure, or the bundle's (an fp16 engine whose logits overflow), not a bug: its line says which
    # engine and what to do, and the slot went back, so no traceback to report.
    if isinstance(exc, (DeviceError, BundleError)):
        log.error("request failed %s: %s", "on the device" if isinstance(exc, DeviceError) else "in the bundle", exc)
        return ApiError(500, str(exc))
    log.error("request failed", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}")


def _stopped_error(stop: Stopped, started: bool) -> ApiError:
    if stop.reason == "timeout" and started:  # resent as it is, it would hold a slot as long again
        return ApiError(504, "decoding ran past the server's --timeout; ask for fewer tokens", headers=NO_RETRY)
    if stop.reason == "timeout":  # queued, or waiting for its check behind other requests' (tokenizing)
        return ApiError(503, "the request waited past the server's --timeout for its turn (the server is busy)",
                        headers=RETRY_AFTER)
    if stop.reason == "shutdown":
        return ApiError(503, "the server is shutting down", headers=RETRY_AFTER)
    return ApiError(499, "the client closed the connection")  # nobody reads this one


UVICORN_LOG = logging.getLogger("uvicorn.error")  # uvicorn's own lines, its shutdown's among them
FORCE_QUIT = ". (CTRL+C to force quit)"
# Seconds between looks, after the grace period, at the bytes each connection has yet to send: one whose did not change
# from one look to the next has a client that does not read, and is closed (Uvicorn._close_unread).
UNREAD_LOOK = 1.0


def _unsent(transport) -> int:
    """The bytes a connection has yet to send: its transport's, and (Linux) its socket's send queue in the kernel. The
    transport's alone stood still for seconds while a client that reads slowly drained a queue of megabytes."""
    sock = transport.get_extra_info("socket")
    queued = 0
    if sock is not None and hasattr(termios, "TIOCOUTQ"):
        try:
            queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)))[0]
        except OSError:  # not a TCP socket's queue here (macOS: a tty's only)
            pass
    return transport.get_write_buffer_size() + queued


class Uvicorn(uvicorn.Server):
    """uvicorn, which on SIGTERM stops accepting connections and waits for open ones, told to drain the
    scheduler first: requests still decoding after the grace period are stopped and answered cleanly.

    A second SIGINT or SIGTERM while it drains ends the grace period at once, every request answered as at its end;
    a third quits without waiting (uvicorn's force quit: open streams end mid-body, without an error event or [DONE]).
    uvicorn alone quit at the second Ctrl-C and ignored a second SIGTERM."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, grace: float):
        super().__init__(config)
        self.scheduler, self.grace = scheduler, grace
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop it serves on: a signal's handler runs outside it
        self.cut_early = False

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit or self.loop is None:
            super().handle_exit(sig, frame)
        elif not self.cut_early:
            self.cut_early = True
            # through the loop: a signal's handler interrupts the loop's own code, which may hold the locks
            # logging and stopping jobs take
            self.loop.call_soon_threadsafe(self._cut_now)
        else:
            super().handle_exit(sig, frame)
            self.force_exit = True

    def _cut_now(self) -> None:
        log.warning("a second signal: stopping every request now, as at the end of --shutdown-timeout; "
                    "a third quits without answering them")
        self.scheduler.cut_now()

    async def shutdown(self, sockets=None) -> None:
        self.scheduler.drain(self.grace)
        closing = asyncio.ensure_future(self._close_unread())
        UVICORN_LOG.addFilter(self._say_what_signals_do)
        try:
            await super().shutdown(sockets)
        finally:
            UVICORN_LOG.removeFilter(self._say_what_signals_do)
            closing.cancel()  # and its wait for this loop's cut, which the next run's cut must not find

    async def _close_unread(self) -> None:
        """After the grace period: a client that does not read (its socket's buffers full) held the shutdown until
        uvicorn's backstop (--shutdown-timeout + 5 s; a second signal did not shorten it), the response's send waiting
        for it. Its connection is closed, the bytes it left unread dropped, once its unsent bytes stood still from one
        look to the next (UNREAD_LOOK): a client that reads more slowly than its response is written has unsent bytes
        at any instant too, and gets the rest and the stream's clean end (closed at the cut, one reading ~400 KB/s of an
        8 MB stream got 3.2 MB, without them). Unchanged means none left: a response adds none while its writing is
        paused (uvicorn's send waits for the buffer to drain)."""
        await self.scheduler.until_cut()
        unsent: dict = {}  # connection -> its unsent bytes at the last look
        while True:
            looked = {connection: _unsent(connection.transport) for connection in self.server_state.connections}
            for connection, size in looked.items():
                if size and unsent.get(connection) == size:
                    connection.transport.abort()
            unsent = looked
            await asyncio.sleep(UNREAD_LOOK)

    def _say_what_signals_do(self, record: logging.LogRecord) -> bool:
        """uvicorn's "Waiting for connections to close. (CTRL+C to force quit)" (and for background tasks), where a
        second Ctrl-C ends the grace period (handle_exit): only a third quits without waiting."""
        if isinstance(record.msg, str) and record.msg.endswith(FORCE_QUIT):
            record.msg = record.msg.removesuffix(FORCE_QUIT) + (
                " (requests are stopped; a third Ctrl-C or SIGTERM quits without waiting)" if self.scheduler.cut else
                f" (requests get --shutdown-timeout, {self.grace:g} s, to finish; a second Ctrl-C or SIGTERM stops them "
                "now, a third quits without waiting)")
        return True


UNREADABLE = json.dumps(ApiError(400, "the request is not valid HTTP/1.1: its request line, a header, its "
                                      "Content-Length or a chunk of its body is malformed").body()).encode()

# How long a connection beyond --max-connections stays open after its 503, for a client that does not close it.
REFUSED_LINGER = 1.0  # seconds


def _refusing_beyond(http_protocol: type, max_connections: int, refused: Callable[[], None]) -> type:
    """uvicorn's HTTP protocol, which answers 503 to a connection beyond max_connections only once it sends a request,
    and holds it open until then: idle connections past the limit each kept a file, until the process had none left
    (every accept then failed, asyncio logged each try, thousands of tracebacks a second, and new clients hung).
    Such a connection is answered at once and closed, so it holds a file for at most REFUSED_LINGER seconds, and
    refused() is called (the metrics count it). The protocol's own 400, for a request its parser cannot read, is
    OpenAI-shaped as the app's errors are."""
    error = ApiError(503, f"the server has {max_connections} connections open, its --max-connections; retry shortly")
    body = json.dumps(error.body()).encode()
    refusal = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
               b"retry-after: 1\r\nconnection: close\r\n\r\n%s" % (len(body), body))

    class Protocol(http_protocol):
        refused = False

        def send_400_response(self, msg: str) -> None:
            """A request uvicorn's parser cannot read (a malformed request line, header, Content-Length or chunk) is
            answered there, before the app: in text/plain, which an OpenAI client reports as an unreadable error.
            The same 400, OpenAI-shaped; the connection closes after it, as uvicorn closes it. Written as bytes, as
            uvicorn's httptools protocol writes it: its h11 one raised where the request's response had gone out
            before its bad chunk came (a traceback in the log, from any client)."""
            default_headers = b"".join(b"%s: %s\r\n" % header for header in self.server_state.default_headers)
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\n%scontent-type: application/json\r\ncontent-length: "
                                 b"%d\r\nconnection: close\r\n\r\n%s" % (default_headers, len(UNREADABLE), UNREADABLE))
            self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.refused = True
                refused()
                # Not counted as open: lingering, it would hold a place of the limit, and a newcomer would be
                # refused while fewer than max_connections were served
                self.connections.discard(self)
                transport.write(refusal)
                transport.write_eof()  # the 503, then the end; what the client sends is read and dropped (closing
                # with it unread would reset the connection, and the client could lose the 503)
                self.loop.call_later(REFUSED_LINGER, transport.abort)

        def data_received(self, data: bytes) -> None:
            if not self.refused:
                super().data_received(data)

        def eof_received(self):
            if self.refused:
                self.transport.close()
                return None
            return super().eof_received()

    return Protocol


class Json(JSONResponse):
    """Starlette's JSON response, encoded by protocol.dumps: a piece at a time, halt() called between (see there)."""

    def __init__(self, content, halt: Callable[[], None], **kwargs):
        self.halt = halt  # before Starlette's __init__, which renders the content
        super().__init__(content, **kwargs)

    def render(self, content) -> bytes:
        return protocol.dumps(content, self.halt, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


class Unread(JSONResponse):
    """The reply to a client that has gone. An ASGI 2.4 server's send raises OSError on a closed connection, which
    Starlette passes on from a plain response: it was answered as a bug (500, logged with a traceback)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except OSError:
            pass


class EventStream(StreamingResponse):
    """A streamed response that, however it ends, closes its body generator, then calls `ended`.

    A client that disconnects cancels the response while the generator waits at a `yield`. One gone before the
    first send leaves the generator unstarted, so closing it runs none of its code: under an ASGI 2.4 server, whose
    send raises OSError on a closed connection; `ended` is what stops the job there too."""

    def __init__(self, events: AsyncGenerator[str, None], ended: Callable[[], None]):
        super().__init__(events, headers=UNBUFFERED, media_type="text/event-stream")
        self.events, self.ended = events, ended

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # Starlette's word for that OSError: nobody is left to answer, and it is no bug
            pass
        finally:
            try:
                await self.events.aclose()
            finally:
                self.ended()


def _token_texts(value):
    """A tokenizer_config value with its special tokens (AddedToken objects, as saved) as their text, as vLLM gives them."""
    if isinstance(value, dict):
        return value["content"] if "content" in value else {key: _token_texts(item) for key, item in value.items()}
    return [_token_texts(item) for item in value] if isinstance(value, list) else value


async def _interleaved(streams: list):
    """The items of several async generators as each comes (one generator's: its own, in turn). The first error
    ends it, and closing it closes them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as items:
            async for item in items:
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream) -> None:
        async with aclosing(stream) as items:
            async for item in items:
                await queue.put((item, None))

    pumps = [asyncio.ensure_future(pump(stream)) for stream in streams]
    for each in pumps:
        each.add_done_callback(lambda done: queue.put_nowait((None, done)))
    try:
        for _ in pumps:
            while (got := await queue.get())[1] is None:
                yield got[0]
            if not got[1].cancelled() and got[1].exception():
                raise got[1].exception()
    finally:
        for each in pumps:
            each.cancel()


async def _unless_gone(http: HttpRequest, work: Awaitable[T]) -> T:
    """work's result, or Stopped("cancelled") if the client (`http`'s, whose body is read) leaves first: work is then
    cancelled, as it is when the caller is (a place on the checking thread given up: work not begun never runs)."""
    return await unless(work, _disconnected(http), "cancelled")


async def _disconnected(http: HttpRequest) -> None:
    """Returns when the client has gone (the body is read by now, so the next ASGI message is the disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


ENDPOINTS = ("POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /tokenize, POST /detokenize, "
             "GET /tokenizer_info, GET /health, GET /version and GET /metrics")


async def _http_error(request: HttpRequest, exc: HTTPException) -> Response:
    # Starlette's "Not Found" and "Method Not Allowed" name neither the request nor what would do: a client whose
    # base_url lacks /v1 (the usual slip) met "Not Found" on every call.
    message, method, path = exc.detail, request.method, request.scope["path"]
    if exc.status_code == 404:
        under_v1 = any(route.matches({**request.scope, "path": "/v1" + path})[0] == Match.FULL for route in request.app.routes)
        message = (f"{method} {path} is not served here; " +
                   (f"the API is under /v1 ({method} /v1{path}): a client's base_url ends in /v1" if under_v1
                    else f"this server serves {ENDPOINTS}"))
    elif exc.status_code == 405 and exc.headers and "Allow" in exc.headers:
        message = f"{method} is not allowed on {path}: send {exc.headers['Allow']}"
    return JSONResponse(ApiError(exc.status_code, message).body(), exc.status_code,
                        headers=exc.headers)  # 405's Allow


async def _internal_error(request: HttpRequest, exc: Exception) -> Response:
    return JSONResponse(_as_api_error(exc).body(), 500)
