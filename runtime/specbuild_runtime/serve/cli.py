"""The `serve` command (`specbuild serve`, or `specbuild-serve` where only the runtime is installed) and
the server's process: load the bundle, run uvicorn, drain on SIGTERM."""

from __future__ import annotations

import io
import ipaddress
import json
import math
import os
import re
import resource
import socket
import sys
import time
import traceback
from pathlib import Path

import click

from ..engine import CAPTURED_BY_DEFAULT, DEVICES
from ..errors import SpecbuildError
from ..grammar import GRAMMAR_CACHE
from ..manifest import runtime_version
from .protocol import GENERATION_CONFIG_MODES
from .tools import PARSERS, VLLM_ONLY, missing_markers


class Finite(click.FloatRange):
    """A float range that also refuses nan and inf (which compare false with any bound). Here, where
    both command lines (the runtime's serve and specbuild's) can import it."""

    def convert(self, value, param, ctx):
        value = super().convert(value, param, ctx)
        if not math.isfinite(value):
            self.fail(f"{value} is not a finite number", param, ctx)
        return value


# Shared with specbuild's generate, bench and verify.
cuda_graphs_option = click.option(
    "--cuda-graphs/--no-cuda-graphs", default=None,
    help="Run the engines' greedy-only graphs, each call shape captured once and replayed as a CUDA graph (sampling "
         "runs the bundle's sampler after each call, uncaptured), or the full graphs uncaptured.  [default: CUDA "
         "graphs on cuda for the bundles `specbuild inspect` says (unquantized "
         f"{', '.join(f'{a} {chr(47).join(p)}' for a, p in sorted(CAPTURED_BY_DEFAULT.items()))}) with one slot "
         "(serve --parallel 1: several slots' captured calls take turns), off otherwise]")
draft_steps_option = click.option(
    "--draft-steps/--no-draft-steps", default=None,
    help="Greedy rounds draft with the draft's steps graph, several tokens a call (a second session of the draft's "
         "weights), or a call per draft token: the same drafts.  [default: steps on cuda, a call per token on cpu]")


def threads_option(default: str, applies_to: str = "onnxruntime threads per engine call"):
    """--threads, shared with specbuild's generate, bench and verify: a pipeline on a shared machine bounds every
    command's threads, not only the server's."""
    # onnxruntime crashes (SIGSEGV) where it cannot start a pool's threads; a thousand is far above any core count.
    return click.option("--threads", type=click.IntRange(min=1, max=1024), help=f"{applies_to}.  [default: {default}]")


def _chat_template(ctx, param, value: str | None):
    """--chat-template read and compiled while the command line is parsed: a wrong one is refused before the
    bundle loads (and before serve takes its port)."""
    if value is None:
        return None
    try:
        from .chat import supplied_chat_template
    except ImportError as exc:  # jinja2, in the serve extra (specbuild generate --chat may run without it)
        raise click.ClickException(f"--chat-template renders with jinja2 ({exc}): pip install "
                                   "'specbuild-runtime[serve]'") from None
    try:
        return supplied_chat_template(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


# Shared with specbuild's generate --chat.
chat_template_option = click.option(
    "--chat-template", metavar="PATH|TEMPLATE", callback=_chat_template,
    help="Render chat messages with this jinja2 chat template instead of the bundle's (a bundle whose tokenizer has none "
         "gets one), as vLLM's --chat-template: a file, or else the template text itself (a value holding no '{', '}' "
         "or newline is taken for a path, and one that cannot be read is an error).  [default: the bundle's]")


class ToolParserChoice(click.Choice):
    """--tool-call-parser's formats: a name of vLLM's that this server lacks is told so, with the ones it has."""

    def convert(self, value, param, ctx):
        if value in VLLM_ONLY:
            self.fail(f"{value} is a vLLM parser this server does not have; it reads {', '.join(self.choices)} (pick "
                      "the format your model writes, or leave the option out)", param, ctx)
        return super().convert(value, param, ctx)


class Interruptible:
    """A click command (or group) whose Ctrl-C reaches run_command as click's Abort, raised before click's main
    sees the KeyboardInterrupt: click first writes an empty line to stderr there, which made "error: interrupted"
    a build log's second line. On a terminal the line is kept, so that the error does not follow the echoed ^C."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            if sys.stderr is not None and sys.stderr.isatty():
                click.echo(err=True)
            raise click.exceptions.Abort() from exc


class InterruptibleCommand(Interruptible, click.Command):
    """A command whose unknown options that other tools take (foreign: the option -> the rest of its one line) say
    what to do instead: click's own answer suggested a look-alike that does something else (serve's
    --tensor-parallel-size: "Did you mean '--parallel'?", which sets slots, not tensor parallelism; compile's --dtype:
    "Did you mean '--tp'?")."""

    def __init__(self, *args, foreign: dict[str, str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.foreign = foreign or {}

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, list(args))
        except click.UsageError:
            name = self.foreign_given(ctx, args)
            if name is None:
                raise
            raise click.UsageError(f"{name} {self.foreign[name]}", ctx) from None

    def foreign_given(self, ctx, args) -> str | None:
        """The first foreign option args give as an option, not as a value (a prompt may be "--dtype" or "-ngl"):
        args parsed again with them declared, each with a value or none. Matched against the option click named
        instead, -ngl 99 (read as -n gl) was told of for `-p -ngl -n 0`, and missed for `-ngl 99 -n 5`."""
        parser = self.make_parser(ctx)
        parser.ignore_unknown_options = True  # an unknown option before one of them (--temprature) does not hide it
        foreign = {}
        for name in self.foreign:
            foreign[name] = click.Option([name], is_flag=False, flag_value="")
            foreign[name].add_to_parser(parser, ctx)
        try:
            _, _, order = parser.parse_args(list(args))
        except click.UsageError:  # click's own answer then (one of our options left without its value)
            return None
        return next((name for param in order for name, option in foreign.items() if param is option), None)


# vLLM's serve options that this server does not take, each with what to do instead.
_ONE_DEVICE = ("a bundle's engines run on one device (--parallel, vLLM's --max-num-seqs, sets the requests decoded at "
               "once): leave it out")
VLLM_ONLY_OPTIONS = {
    "--max-model-len": "the context is the bundle's, set by `specbuild compile --max-seq-len` (`specbuild inspect` "
                       "shows it): leave it out",
    "--tensor-parallel-size": _ONE_DEVICE,
    "-tp": _ONE_DEVICE,
    "--gpu-memory-utilization": "each of the --parallel slots reserves a whole context's KV cache at start, and a "
                                "count memory cannot hold is refused: leave it out",
    "--dtype": "the precision is the bundle's, set by `specbuild compile --precision`: leave it out",
    "--quantization": "weights are quantized as the bundle is compiled (`specbuild compile --quantize`): leave it out",
    "--enforce-eager": "give --no-cuda-graphs instead",
}

# llama.cpp's options (llama-cli's, llama-server's) that no specbuild command running a bundle takes, each with what to
# do instead; its draft length (--draft-max) is each command's own. click answered --ctx-size with "Did you mean
# '--max-connections'?" and -ngl 99 (read as -n gl) with "'gl' is not a valid integer".
_WHOLE = "layers run where --device says; a bundle runs whole on one device (--device cuda: a GPU): leave it out"
_BUNDLE = "the bundle's folder is the command's first argument: give it there, without the option"
LLAMA_CPP_ONLY_OPTIONS = {
    "-ngl": _WHOLE, "--n-gpu-layers": _WHOLE, "--gpu-layers": _WHOLE,
    "-c": VLLM_ONLY_OPTIONS["--max-model-len"], "--ctx-size": VLLM_ONLY_OPTIONS["--max-model-len"],
    "-m": _BUNDLE, "--model": _BUNDLE,
}
LLAMA_CPP_DRAFT_MAX = ("--draft-max", "--draft", "--draft-n")


def foreign_answers(who: str, vllm: tuple[str, ...] = tuple(VLLM_ONLY_OPTIONS)) -> dict[str, str]:
    """The answers of `who` (a command) to vLLM's options named in vllm and to llama.cpp's it does not take."""
    return {**{name: f"is vLLM's option, which {who} does not take: {VLLM_ONLY_OPTIONS[name]}" for name in vllm},
            **{name: f"is llama.cpp's option, which {who} does not take: {what}"
               for name, what in LLAMA_CPP_ONLY_OPTIONS.items()}}


# -h as on every specbuild command: `specbuild serve` takes it from the group, specbuild-serve only from here.
@click.command("serve", cls=InterruptibleCommand,
               foreign={**foreign_answers("this server"),
                        **{name: "is llama.cpp's option, which this server does not take: drafts per round adapt up "
                                 "to the bundle's max gamma (`specbuild compile --gamma`): leave it out"
                           for name in LLAMA_CPP_DRAFT_MAX}},
               context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
# The runtime's version, the serve command's package: a service that installs it alone has no `specbuild --version`.
@click.version_option(runtime_version(), prog_name="specbuild-serve")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port to listen on.")
@click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True,
              help="Where the engines run: cuda needs onnxruntime-gpu (pip install './runtime[gpu]'); auto takes CUDA if "
                   "present.")
@cuda_graphs_option
@draft_steps_option
@click.option("--parallel", "--max-num-seqs", "parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="Requests decoded at once (slots, each with its own KV cache reserved at start); the engines are "
                   "shared. --max-num-seqs is vLLM's name for it.")
@threads_option("cores (those a container's CPU limit grants, where fewer) / --parallel, at least 1")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait for a slot or for their check (tokenizing; /tokenize and /detokenize "
                   "too), a batch's prompts each one; more get 429 with Retry-After, and a batch of over --parallel "
                   "+ this many prompts a 400.")
@click.option("--grammar-cache", type=click.IntRange(min=1), default=GRAMMAR_CACHE, show_default=True,
              help="Compiled grammars (structured outputs, response_format, forced tool calls) kept for requests that "
                   "send the same one again, the least recently used dropped first; the largest schemas hold tens of "
                   "MB each.")
@click.option("--timeout", type=Finite(min=0), default=600.0, show_default=True,
              help="Seconds a request may take from arrival to its last token (a /tokenize or /detokenize: to the "
                   "end of its tokenizing; 0 = no limit).")
@click.option("--shutdown-timeout", type=Finite(min=0), default=30.0, show_default=True,
              help="On SIGTERM, seconds in-flight requests get to finish before they are cut (a second signal cuts "
                   "them at once).")
@click.option("--max-connections", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Open connections at once; more get 503 (slow or idle clients cannot exhaust the server's files).")
@click.option("--model-name", "--served-model-name", "model_name", metavar="NAME",
              callback=lambda ctx, param, value: _model_name(value),
              help="The model name clients send and /v1/models lists; --served-model-name is vLLM's name for it (one "
                   "name here).  [default: the bundle folder's name]")
@click.option("--api-key", envvar="SPECBUILD_API_KEY", callback=lambda ctx, param, value: _api_key(value),
              help="Require this key on /v1 routes and the tokenizer's ('Authorization: Bearer KEY', the openai "
                   "client's api_key); /health and /metrics stay open.  [default: $SPECBUILD_API_KEY, else none]")
@click.option("--allowed-origins", multiple=True, metavar="ORIGIN", callback=lambda ctx, param, value: _origins(value),
              help="Let web pages from this origin (e.g. http://localhost:3000) call the API from a browser (CORS); repeat "
                   "it for more, or give vLLM's JSON list; '*': any page.  [default: none]")
@click.option("--check-digests/--no-check-digests", default=True, show_default=True,
              help="Hash every bundle file at start against the manifest (~1.2 GB/s: 13 s for an 8B fp16 bundle); "
                   "skip it for a bundle checked where it was deployed (specbuild inspect checks them).")
@click.option("--generation-config", type=click.Choice(GENERATION_CONFIG_MODES), default="auto", show_default=True,
              help="Where a request that omits temperature, top_p, top_k, min_p or repetition_penalty gets them, as in "
                   "vLLM: auto: the sampling defaults of the target's generation_config.json (compile records them), else "
                   "OpenAI's (temperature 1: sampling); vllm: OpenAI's alone; greedy: none (greedy unless a request sends "
                   "a temperature). The start-up line says which apply.")
@chat_template_option
@click.option("--tool-call-parser", type=ToolParserChoice(list(PARSERS)), default=None,
              help="Parse chat replies' tool calls in this format, as vLLM's --tool-call-parser: hermes reads "
                   "<tool_call>{...}</tool_call> (Qwen2.5, Qwen3, Hermes 2 Pro), llama3_json reads {\"name\": ..., "
                   "\"parameters\": {...}} (Llama 3.1, 3.2, 3.3 Instruct), mistral reads [TOOL_CALLS]... (Mistral, "
                   "Mixtral Instruct), pythonic reads [name(key=value), ...] (Llama 3.2, Llama 4), llama4_pythonic "
                   "the same, also between <|python_start|> and <|python_end|> (Llama 4), into the response's "
                   "tool_calls, and lets requests send tools with tool_choice \"auto\" (the default where tools are "
                   "sent).  [default: none: such requests get 400; tool_choice \"none\" shows the tools and answers "
                   "text; \"required\" and a named function need no parser]")
@click.option("--enable-auto-tool-choice", is_flag=True,
              help="vLLM's switch for tool_choice \"auto\", which --tool-call-parser turns on here: accepted so that "
                   "vLLM's command line runs unchanged, and refused without --tool-call-parser, as vLLM refuses it.")
@click.option("--enable-tokenizer-info-endpoint", is_flag=True,
              help="Answer GET /tokenizer_info (the tokenizer's config and the chat template, which lm-evaluation-harness "
                   "reads to tokenize through the server), as vLLM's switch does; off, it is a 404.")
def serve_command(bundle, host, port, device, cuda_graphs, draft_steps, parallel, threads, max_queue, grammar_cache,
                  timeout, shutdown_timeout, max_connections, model_name, api_key, allowed_origins, check_digests,
                  generation_config, chat_template, tool_call_parser, enable_auto_tool_choice,
                  enable_tokenizer_info_endpoint) -> None:
    """Serve a bundle over the OpenAI HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /tokenize,
    /detokenize, /health, /metrics."""
    if enable_auto_tool_choice and tool_call_parser is None:  # it would turn on nothing: a parser left out by mistake
        raise click.UsageError(f"--enable-auto-tool-choice needs --tool-call-parser ({'|'.join(PARSERS)}), as in vLLM")
    from ..decode import SpeculativeDecoder, graphs_by_default
    from ..engine import available_cpus, use_shared_thread_pool
    try:
        from .app import Server, Settings
    except ImportError as exc:
        raise click.ClickException(f"serving needs the serve extra ({exc}): pip install 'specbuild-runtime[serve]'") from None

    explicit = click.get_current_context().get_parameter_source("max_connections") != click.core.ParameterSource.DEFAULT
    max_connections = _open_files_for(max_connections, explicit)
    listener = _listen(host, port)  # before loading: a taken port is refused at once, in one line
    # One pool for every session and slot, sized so that `parallel` calls at once fill the cores and no more:
    # concurrent calls each running a pool of one thread per core fight over the cores (docs/serving.md). The
    # cores a container's CPU limit grants, not the host's it sees.
    use_shared_thread_pool(threads or max(1, available_cpus() // parallel))
    decoder = SpeculativeDecoder(bundle, device=device, parallel=parallel, shared_thread_pool=True, cuda_graphs=cuda_graphs,
                                 draft_steps=draft_steps, check_digests=check_digests, grammar_cache=grammar_cache)
    missing = missing_markers(tool_call_parser, decoder.tokenizer) if tool_call_parser else []
    if missing:  # as vLLM refuses it: otherwise every reply would be answered as text, without a word
        raise click.ClickException(
            f"--tool-call-parser {tool_call_parser} reads calls marked by {' and '.join(missing)}, which this bundle's "
            "tokenizer has no token for, so its model does not write them; give the parser its model card names "
            f"({'|'.join(PARSERS)}), or leave the option out")
    settings = Settings(model=model_name or Path(bundle).resolve().name, max_queue=max_queue,
                        timeout=timeout or None, shutdown_timeout=shutdown_timeout, max_connections=max_connections,
                        api_key=api_key, generation_config=generation_config, allowed_origins=allowed_origins,
                        chat_template=chat_template, tool_call_parser=tool_call_parser,
                        tokenizer_info=enable_tokenizer_info_endpoint)
    server = Server(decoder, settings)
    if cuda_graphs is None and parallel > 1 and decoder.device == "cuda" and graphs_by_default(decoder.manifest, "cuda"):
        click.echo(f"CUDA graphs off with {parallel} slots: captured calls would take turns across them "
                   "(--cuda-graphs captures anyway)", err=True)
    if decoder.target.captures:  # every worker thread captures its slot's now, so that no request waits for one
        click.echo(f"capturing CUDA graphs on {parallel} slot(s) before serving...", err=True)
        started = time.perf_counter()
        captured = decoder.warm_up_workers()
        click.echo(f"captured {captured} CUDA graphs in {time.perf_counter() - started:.1f} s", err=True)
    where = f"[{host}]" if ":" in host else host
    address, bound_port = listener.getsockname()[:2]
    click.echo(f"serving {settings.model!r} from {bundle} on http://{where}:{bound_port}{exposure(address, api_key)}: "
               f"{parallel} slot(s), queue {max_queue}; {chat_line(server.chat_template)}"
               f"{f'; tool calls parsed as {tool_call_parser}' if tool_call_parser else ''}; {server.defaults}", err=True)
    server.http_server(host, port).run(sockets=[listener])


def exposure(address: str, api_key: str | None) -> str:
    """A clause for the start-up line where the server listens beyond loopback (address: the bound one) without
    --api-key: anyone who reaches the port may use it, which docs/serving.md advises against, and nothing said so."""
    ip = ipaddress.ip_address(address)
    # --host ::ffff:127.0.0.1 binds loopback, which Python before 3.13 does not call loopback in its IPv6 spelling
    if api_key or (getattr(ip, "ipv4_mapped", None) or ip).is_loopback:
        return ""
    return " (open to the network without --api-key: anyone who reaches it may use it; give --api-key KEY, or --host " \
           "127.0.0.1)"


def chat_line(template) -> str:
    """Which template /v1/chat/completions renders, for the start-up line: a bundle may have none, or an operator's
    in place of its own."""
    if template is None:
        return "no chat template (/v1/chat/completions answers 400; --chat-template gives one)"
    return f"chat template from {template.origin}"


def _model_name(value: str | None) -> str | None:
    """A name clients can send: an empty one fell back to the folder's name, which no client was told."""
    if value is not None and not value.strip():
        raise click.BadParameter("must not be empty; give the name clients send, or leave it out for the bundle "
                                 "folder's name", param_hint="--model-name")
    return value


def _api_key(value: str | None) -> str | None:
    """The key as an HTTP header carries it: printable ASCII (a client could not send another)."""
    if value is None and os.environ.get("SPECBUILD_API_KEY") == "":  # click takes an empty variable for unset
        raise click.BadParameter("SPECBUILD_API_KEY is set but empty, which would leave the server open; set the key, "
                                 "or unset the variable to serve without one", param_hint="--api-key")
    if value is not None and not (value and value.isascii() and value.isprintable() and value.strip() == value):
        raise click.BadParameter("must be a non-empty string of printable ASCII without leading or trailing spaces",
                                param_hint="--api-key")
    return value


def _origins(values: tuple[str, ...]) -> tuple[str, ...]:
    """The origins of repeated values, or of vLLM's JSON list, each as a browser sends it: one with a path or a
    trailing slash would match no page, silently."""
    origins = []
    for value in values:
        if value.lstrip().startswith("["):
            try:
                listed = json.loads(value)
            except json.JSONDecodeError:
                listed = None
            if not (isinstance(listed, list) and all(isinstance(origin, str) for origin in listed)):
                raise click.BadParameter(f"{value!r} is not a JSON list of origins", param_hint="--allowed-origins")
            origins += listed
        else:
            origins.append(value)
    for origin in origins:
        if origin != "*" and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/?#\sA-Z]+", origin):
            raise click.BadParameter(f"{origin!r} is not an origin: give scheme://host[:port] as a browser sends it "
                                     "(e.g. http://localhost:3000: lower case, no path or trailing slash), or '*' for any",
                                     param_hint="--allowed-origins")
    return tuple(origins)


# Files the server holds beside its connections: the listening socket, the event loop's, onnxruntime's and a GPU
# driver's, the bundle's while it loads, and connections beyond --max-connections while they are refused.
OWN_FILES = 256


def _open_files_for(max_connections: int, explicit: bool) -> int:
    """The connections the server can hold: a file for each, and OWN_FILES more. Below that (1024 is systemd's soft
    limit for a service, and the default --max-connections), accept failed before the limit was reached: asyncio
    logged a traceback for each try, thousands a second, and new clients hung instead of getting a 503. The soft limit
    is raised as far as needed, as vLLM's server raises it; where the hard limit (or a system's cap below it: macOS's
    kern.maxfilesperproc) is lower, the default --max-connections shrinks to fit (said in one line) and one that was
    asked for is refused."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = max_connections + OWN_FILES
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return max_connections
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
        return max_connections
    except (ValueError, OSError):  # above the hard limit, or above the system's cap
        cap = _highest_allowed(soft, needed, hard)
    which = "ulimit -Hn" if cap == hard else "the system's cap"
    fits = cap - OWN_FILES
    if explicit or fits < 1:
        # below OWN_FILES + 1 no --max-connections fits: the limit is all there is to raise
        advice = f"give --max-connections {fits} or less, or raise the limit" if fits >= 1 else \
            f"raise the limit to {OWN_FILES + 1} or more"
        raise SpecbuildError(f"--max-connections {max_connections} needs {needed} open files (one a connection, "
                             f"{OWN_FILES} for the server) but this process may open {cap} ({which}): {advice}")
    click.echo(f"note: --max-connections {fits} (not {max_connections}): this process may open {cap} files "
               f"({which}); raise that limit for more", err=True)
    resource.setrlimit(resource.RLIMIT_NOFILE, (cap, hard))
    return fits


def _highest_allowed(soft: int, refused: int, hard: int) -> int:
    """The highest soft open-files limit the system grants below `refused` (found by asking; the limit is left at
    soft): its cap is nowhere portable to read."""
    low, high = soft, refused
    while high - low > 1:
        middle = (low + high) // 2
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (middle, hard))
            low = middle
        except (ValueError, OSError):
            high = middle
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    except (ValueError, OSError):
        pass
    return low


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, for uvicorn to listen on; uvicorn's own bind failure is a log
    message, a traceback-free but multi-line exit."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn sets it
        listener.bind(address)
    except (OSError, UnicodeError) as exc:  # UnicodeError: the idna codec refuses an empty or 64+ character label
        reason = getattr(exc, "strerror", None) or exc
        raise SpecbuildError(f"cannot listen on {host}:{port} ({reason}); choose another --port, or a --host this "
                             "machine has") from None
    return listener


EXIT_INPUT, EXIT_USAGE, EXIT_BUG, EXIT_INTERRUPTED = 1, 2, 3, 130


def run_command(command: click.Command, args: list[str] | None, prog_name: str, debug: bool = False,
                bug_hint: str = "") -> int:
    """Run a click command as `specbuild` and `specbuild-serve` do: every failure one line on stderr,
    "error: ...", and an exit status that says whose it is: 1 an input, bundle or setting is wrong, 2 the
    command line is malformed, 3 a bug (bug_hint says how to report it), 130 interrupted. debug prints the
    traceback above the line."""
    def fail(message: str, status: int, trace: bool = True) -> int:
        if debug and trace:
            traceback.print_exc()
        click.echo("error: " + " ".join(message.split()), err=True)  # one line, whatever the message holds
        return status

    if isinstance(sys.stdout, io.TextIOWrapper):
        # A stdout whose encoding cannot spell a generated character (PYTHONIOENCODING=latin-1, a cp1252 console
        # redirected) shows it escaped, as Python's stderr does, instead of ending the command as a bug. --json
        # output is ASCII either way.
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        return command.main(args, prog_name=prog_name, standalone_mode=False) or 0
    except click.exceptions.NoArgsIsHelpError as exc:  # the command alone: the help, not an error
        click.echo(exc.format_message(), err=True)
        return EXIT_USAGE
    except click.UsageError as exc:  # click's own show() is three lines (usage, hint, error)
        where = exc.ctx.command_path if exc.ctx else prog_name
        message = exc.format_message()
        if message.startswith("Got unexpected extra argument"):  # an unquoted prompt, or `--choice yes no`
            message += (": an option takes one value, so quote a value holding spaces (--prompt \"def fib(n):\") and "
                        "repeat an option for several (--stop A --stop B)")
        return fail(f"{message} (see '{where} --help')", EXIT_USAGE, trace=False)
    except (click.exceptions.Abort, KeyboardInterrupt) as exc:  # click turns a KeyboardInterrupt (uvicorn's) into Abort
        # A writer that knows what the interrupt left says so in the interrupt's text (specbuild's staged_folder).
        interrupt = exc.__cause__ if isinstance(exc, click.exceptions.Abort) else exc
        return fail(str(interrupt) if isinstance(interrupt, KeyboardInterrupt) and str(interrupt) else "interrupted",
                    EXIT_INTERRUPTED, trace=False)
    except (click.ClickException, SpecbuildError) as exc:
        return fail(exc.format_message() if isinstance(exc, click.ClickException) else str(exc), EXIT_INPUT)
    except OSError as exc:
        if stream := _echoed_to(exc):
            # Bare, "No space left on device" read as the disk a compile writes to, after its bundle was written.
            return fail(f"cannot write the output to {stream} ({exc.strerror or exc}); free space where it goes, or "
                        "send it elsewhere", EXIT_INPUT)
        return fail(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc.strerror or exc), EXIT_INPUT)
    except Exception as exc:
        return fail(f"internal error ({type(exc).__name__}: {exc}); this is a bug in specbuild: {bug_hint}", EXIT_BUG)


def _echoed_to(exc: OSError) -> str | None:
    """"stdout" or "stderr" where exc rose from click.echo writing there (`> /dev/full`, a full disk behind a
    log), else None. click reports a closed pipe itself; every other failed write of the commands' output lands here."""
    frame = exc.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code.co_name == "echo" and frame.tb_frame.f_globals.get("__name__") == "click.utils":
            return "stderr" if frame.tb_frame.f_locals.get("file") is sys.stderr else "stdout"
        frame = frame.tb_next
    return None


def main() -> None:
    """`specbuild-serve`: the same command with the same one-line errors and exit statuses as `specbuild serve`."""
    sys.exit(run_command(serve_command, None, "specbuild-serve", bug_hint="report it with the command line "
                         "(`specbuild --debug serve ...`, where specbuild is installed, shows the traceback)"))
