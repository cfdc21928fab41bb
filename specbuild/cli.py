"""The `specbuild` command line: verbs for build pipelines (compile, verify) and for people (generate, inspect).

Every failure is one line on stderr starting with "error: ", and the exit status says whose it is:
0 done; 1 an input, bundle, output or request is wrong, a package is missing, or the command's check failed
(`verify` found a divergence); 2 the command line is malformed (usage: a value, a missing option, options in
conflict); 3 a bug in specbuild; 130 interrupted (Ctrl-C, or SIGTERM or SIGHUP while writing a bundle or
checkpoint). docs/commands.md (Exit statuses) draws the line between 1 and 2. A reader that closes stdout early
(`| head`) ends the command quietly with 1 (click's way). `specbuild --debug ...` shows the traceback too.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from specbuild_runtime.engine import DEVICES, available_cpus
from specbuild_runtime.errors import RequestError
from specbuild_runtime.logprobs import floored
from specbuild_runtime.serve.cli import (LLAMA_CPP_DRAFT_MAX, Finite, Interruptible, InterruptibleCommand,
                                        chat_template_option, cuda_graphs_option, draft_steps_option, foreign_answers,
                                        run_command, serve_command, threads_option)
from specbuild_runtime.validation import FLOAT32_MAX, GREEDY_BELOW, MAX_LOGPROBS, check_seed, stop_strings

from . import __version__
from .bench.bench import DEFAULT_GAMMAS
from .bench.peers import KNOWN as PEERS
from .progress import count
from .recipe import (BACKENDS, DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE, DEFAULT_GAMMA, DEFAULT_MAX_SEQ_LEN,
                     DISTILL_BATCH_SIZE, DISTILL_GAMMA, DISTILL_MINUTES, DISTILL_OBJECTIVE, DISTILL_OBJECTIVES,
                     DISTILL_RULES, DISTILL_SEED, MAX_GAMMA, MAX_SEED, PRECISIONS, QUANTIZATIONS, RULES,
                     distill_conflict)
from .staging import replace_file

# Whether main() runs as the `specbuild` command, which may drop interrupts once its work is done (see
# done()); a Python caller of main() keeps its own handlers.
_as_command = False

# Not exists=True: a missing folder gets the command's own one-line error, which says what to pass instead.
folder_path = click.Path(file_okay=False, path_type=Path)
device_option = click.option(
    "--device", type=click.Choice(DEVICES), default="cpu", show_default=True,
    help="Where the engines run: cuda needs onnxruntime-gpu (pip install './runtime[gpu]'); auto takes CUDA if present.")
EVERY_CORE = "one per core, or per CPU a container's CPU limit grants where fewer"
BENCH_GAMMAS = ",".join(map(str, DEFAULT_GAMMAS))  # bench --gamma's default, as the option takes it


def use_threads(threads: int | None, torch_too: bool = False) -> None:
    """--threads: the size of the onnxruntime pool every session of the command shares (set before the first
    session), and with torch_too of torch's (transformers beside the bundle), so that a command on a shared
    machine takes no more cores than it was given. Without it, torch_too bounds torch's threads by the CPUs a
    container's CPU limit grants (onnxruntime's pools are bounded where they are made: engine.quota_threads)."""
    from specbuild_runtime.engine import use_shared_thread_pool

    if threads is None:
        # torch counts the host's cores, as onnxruntime does; imported only where fewer are ours (it takes seconds)
        if torch_too and (cpus := available_cpus()) < (os.cpu_count() or 1):
            import torch

            torch.set_num_threads(min(torch.get_num_threads(), cpus))
        return
    use_shared_thread_pool(threads)
    if torch_too:
        import torch

        torch.set_num_threads(threads)


class Setting(click.ParamType):
    """A compile option, checked by the same rule as its recipe key (recipe.RULES), or a distill option, by the rule
    distill() checks its argument with (recipe.DISTILL_RULES); kind converts the text first."""

    def __init__(self, key: str, rules: dict = RULES, kind: click.ParamType = click.INT):
        self.rule, self.kind, self.name = rules[key], kind, kind.name

    def convert(self, value, param, ctx):
        value = self.kind.convert(value, param, ctx)
        if problem := self.rule(value):
            self.fail(problem, param, ctx)
        return value


class Precision(click.Choice):
    """--precision, whose int8 and int4 say what gives them: click's answer listed fp32, fp16 and bf16 alone."""

    def __init__(self) -> None:
        super().__init__(PRECISIONS)

    def convert(self, value, param, ctx):
        if value in QUANTIZATIONS[1:]:  # onnxruntime-genai's model builder takes them as precisions (-p int4)
            self.fail(f"{value!r} is a weight quantization, not a float type ({', '.join(PRECISIONS)}): give "
                      f"--quantize {value}", param, ctx)
        return super().convert(value, param, ctx)


class CommaList(click.ParamType):
    """Comma-separated values, each converted and checked by item_type; with `empty` (what to give
    instead) an empty list is refused, where it means nothing (none: it means none, as no peers)."""

    def __init__(self, item_type: click.ParamType, empty: str | None = None):
        self.item_type, self.empty = item_type, empty
        self.name = f"{item_type.name},..."

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        items = [self.item_type.convert(item.strip(), param, ctx) for item in value.split(",") if item.strip()]
        if not items and self.empty:
            self.fail(f"{value!r} names none; {self.empty}", param, ctx)
        return list(dict.fromkeys(items))  # each once, in the order given


class KeyValue(click.ParamType):
    """KEY=VALUE as (key, value), the value read as JSON where it is JSON (2, 0.5, true) and kept as text otherwise.
    A type, so that a malformed one is refused as the command line is parsed: refused in the command's body, it
    came after distill had imported torch and transformers (4.5 s on 2 cores)."""

    name = "KEY=VALUE"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        key, sep, text = value.partition("=")
        if not sep or not key:
            self.fail(f"{value!r} is not KEY=VALUE; write it as num_hidden_layers=2", param, ctx)
        try:
            return key, json.loads(text)
        except json.JSONDecodeError:
            return key, text


class PromptText(click.ParamType):
    """Text that is valid UTF-8 (Python hands undecodable argv bytes over as lone surrogates); "-" reads it
    from stdin (a long prompt, a file: `-p - < prompt.txt`)."""

    name = "text"

    def convert(self, value, param, ctx):
        if value == "-":
            if sys.stdin is None:  # the shell closed it (`<&-`): Python has no stdin object at all
                self.fail("- reads the prompt from stdin, which is closed; pipe the prompt in (-p - < prompt.txt)",
                          param, ctx)
            try:
                return sys.stdin.buffer.read().decode("utf-8")
            except UnicodeDecodeError:
                self.fail("- : stdin is not valid UTF-8 text", param, ctx)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            self.fail("is not valid UTF-8 text", param, ctx)
        return value


class TextOrFile(click.ParamType):
    """Text, or with a leading @ the UTF-8 text of the file it names (a JSON schema or grammar is often long, as curl's
    @FILE); as_json: parsed as JSON (a JSON schema)."""

    def __init__(self, as_json: bool = False):
        self.as_json = as_json
        self.name = "JSON|@FILE" if as_json else "TEXT|@FILE"

    def convert(self, value, param, ctx):
        text = value
        if value.startswith("@"):
            try:
                text = Path(value[1:]).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                self.fail(f"cannot read {value[1:]!r} ({getattr(exc, 'strerror', None) or exc}): give a readable UTF-8 "
                          "file after @, or the text itself", param, ctx)
        if not self.as_json:
            return text
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            self.fail(f"is not JSON ({exc.msg}, line {exc.lineno} column {exc.colno}): give a JSON schema, or @FILE "
                      "holding one", param, ctx)


# generate's structured output flags, by the key of the runtime's structured_outputs each sets.
STRUCTURED_FLAGS = {"json": "--json-schema", "regex": "--regex", "choice": "--choice", "grammar": "--grammar"}


def structured_outputs(given: dict):
    """The one structured output generate's flags ask for, given by the runtime's keys (grammar.Structured, whose
    messages name the flag), None for none, or a usage error: two at once, or a grammar llguidance cannot compile
    (checked before the bundle loads)."""
    asked = {key: spec for key, spec in given.items() if spec is not None}
    if len(asked) > 1:
        raise click.UsageError(f"{' and '.join(map(STRUCTURED_FLAGS.get, asked))} each ask for a structured output: "
                               "give one")
    if not asked:
        return None
    from specbuild_runtime.grammar import check_structured_outputs

    try:
        return check_structured_outputs(asked, STRUCTURED_FLAGS[next(iter(asked))])
    except RequestError as exc:
        raise click.UsageError(str(exc)) from None


class Float32(Finite):
    """A number the engines take as float32, where one beyond its largest (3.4e38) is inf."""

    def convert(self, value, param, ctx):
        value = super().convert(value, param, ctx)
        if abs(value) > FLOAT32_MAX:
            self.fail(f"{value} is beyond float32's largest number ({FLOAT32_MAX:.3g}), the engines' type for it",
                      param, ctx)
        return value


class Seed(click.ParamType):
    """A seed as the runtime takes it (validation.check_seed), checked as the command line is parsed."""

    name = "integer"

    def convert(self, value, param, ctx):
        number = click.INT.convert(value, param, ctx)
        try:
            check_seed(number)
        except RequestError:
            # the command line's own words, which the README's troubleshooting table quotes (check_seed's message
            # names the API's argument: "seed must be >= -1")
            self.fail(f"{number} is not a seed: give a whole number >= 0, or -1 for a random seed (llama.cpp's)",
                      param, ctx)
        return number


def sampling_options(temperature_help: str = "0 (or below 1e-5) decodes greedily; above, samples losslessly from "
                     "the target's distribution.",
                     seed_help: str = "Seed for sampling (0 or more): it reproduces a run exactly, at a fixed "
                                      "--gamma or auto; greedy decoding ignores it; -1 samples with a random seed, as "
                                      "llama.cpp's.  [default: none: each run samples anew]",
                     seed_default: int | None = None):
    """--temperature/--top-k/--top-p/--seed, named as in the Python API."""
    def decorate(command):
        for option in reversed([
            click.option("--temperature", type=Float32(min=0), default=0.0, show_default=True, help=temperature_help),
            click.option("--top-k", type=click.IntRange(min=-1), default=0, show_default=True,
                         help="Sample from the k most likely tokens (0 or -1, vLLM's: all)."),
            click.option("--top-p", type=Finite(min=0, max=1, min_open=True), default=1.0, show_default=True,
                         help="Sample from the smallest set of tokens holding this much probability."),
            click.option("--seed", type=Seed(), default=seed_default, show_default=seed_default is not None,
                         help=seed_help),
        ]):
            command = option(command)
        return command
    return decorate


class GammaType(click.ParamType):
    """'auto' or a whole number, 0 or more: the bundle says its own maximum (manifest gamma) when it loads."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        if value == "auto" or (isinstance(value, int) and value >= 0):
            return value
        if str(value).isdecimal():  # what int() reads; isdigit() also takes "²", which int() refuses
            return int(value)
        self.fail(f"{value!r} is not 'auto' or a whole number, 0 or more", param, ctx)


# generate's and chat's
gamma_option = click.option(
    "--gamma", type=GammaType(), default="auto", show_default=True,
    help="Draft tokens per round, up to the bundle's max gamma (compile's --gamma; inspect shows it): 'auto' adapts to "
         "the draft's acceptance, 0 is the target alone.")


def check_stops(ctx, param, value: tuple[str, ...]) -> tuple[str, ...]:
    """--stop by the runtime's rule for stop strings (validation.stop_strings), before the bundle loads: an
    empty one, or a seventeenth, is a malformed option whatever the bundle, as click's own range checks are."""
    try:
        stop_strings(list(value))
    except RequestError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    return value


# generate's and chat's (in chat each reply is an output)
stop_option = click.option(
    "--stop", multiple=True, metavar="TEXT", callback=check_stops,
    help="End the output where it would contain TEXT (repeatable, up to 16; as the API's stop strings).")


def output_shaping_options(command):
    """generate's and chat's --min-p, penalties and --min-tokens, named as in the Python API (bench's sampling is
    sampling_options' alone)."""
    for option in reversed([
        click.option("--min-p", type=Finite(min=0, max=1), default=0.0, show_default=True,
                     help="Sample only from tokens at least this many times as probable as the most probable "
                          "(0 = all), before --top-k and --top-p, as vLLM."),
        click.option("--repetition-penalty", type=Float32(min=0, min_open=True), default=1.0, show_default=True,
                     help="Divide the positive logits of tokens in the prompt or the output so far by this, multiply "
                          "their negative ones (1 = none), as transformers and vLLM; greedy or sampled."),
        click.option("--presence-penalty", type=Finite(min=-2, max=2), default=0.0, show_default=True,
                     help="Subtract this from the logit of every token the output holds (0 = none), as OpenAI and "
                          "vLLM."),
        click.option("--frequency-penalty", type=Finite(min=-2, max=2), default=0.0, show_default=True,
                     help="Subtract this times its count in the output from each token's logit (0 = none), as OpenAI "
                          "and vLLM."),
        click.option("--min-tokens", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Generate at least this many tokens before an eos or a --stop string may end the output, as "
                          "vLLM's min_tokens."),
    ]):
        command = option(command)
    return command


def decoding_options(command):
    """generate's and chat's: where the engines run and how each reply is sampled and shaped."""
    for option in reversed([device_option, cuda_graphs_option, draft_steps_option, threads_option(EVERY_CORE),
                            sampling_options(), output_shaping_options]):
        command = option(command)
    return command


def check_min_tokens(min_tokens: int, max_new_tokens: int) -> None:
    """The command line at odds with itself: exit 2, before the bundle loads."""
    if min_tokens > max_new_tokens:
        raise click.UsageError(f"--min-tokens {min_tokens} is above --max-new-tokens {max_new_tokens}: give at most "
                               "that many")


def check_sampling(sampling: dict) -> None:
    """--top-k, --top-p and --min-p shape sampling; without --temperature the decode is greedy and would drop them
    (generate's default is greedy whatever the bundle's generation_config says: that is serve's). A --seed is taken
    then, as vLLM and serve take a seed with temperature 0: it changes nothing, and a script that passes one at every
    temperature, 0 included, runs."""
    if sampling["temperature"] >= GREEDY_BELOW:
        return
    given = [name for name, set_ in (("--top-k", sampling["top_k"] > 0), ("--top-p", sampling["top_p"] != 1.0),
                                     ("--min-p", sampling.get("min_p", 0) > 0)) if set_]
    if not given:
        return
    names = (", ".join(given[:-1]) + " and " + given[-1] + " apply") if len(given) > 1 else f"{given[0]} applies"
    # Given, 0 included, but too small to sample with: "give --temperature too" would puzzle
    if click.get_current_context().get_parameter_source("temperature") is not ParameterSource.DEFAULT:
        below = f" is below {GREEDY_BELOW:g}, which" if sampling["temperature"] else ""
        raise click.UsageError(f"{names} to sampling, and --temperature {sampling['temperature']:g}{below} decodes "
                               "greedily: give a larger one (e.g. --temperature 1)")
    raise click.UsageError(f"{names} to sampling: give --temperature too (e.g. --temperature 1)")


class Group(Interruptible, click.Group):
    command_class = InterruptibleCommand


# Other tools' options that click answered with a look-alike (compile's --dtype: "Did you mean '--tp'?"; generate's
# --max-model-len: "Did you mean '--max-new-tokens'?", the reply's length, not the context's), with what to do instead.
COMPILE_FOREIGN = {
    "--device": "is not compile's: its engines run on a CPU or a CUDA GPU, chosen as the bundle runs (generate, chat, "
                "bench, verify or serve --device cuda); for a GPU compile with --precision fp16 or bf16",
    "--dtype": "is vLLM's name for --precision here (fp32, fp16 or bf16)",
    "--num-speculative-tokens": "is vLLM's name for --gamma here (the most drafts per round)",
}


def decoding_foreign(command: str, gamma: str = "drafts per round, up to the bundle's max gamma; auto adapts them"
                     ) -> dict[str, str]:
    """A decoding command's answers to vLLM's and llama.cpp's options: what serve says, and --gamma for their draft
    length (gamma: what that command's --gamma takes)."""
    vllm = ("--dtype", "--max-model-len", "--quantization", "--enforce-eager")
    return {**foreign_answers(f"specbuild {command}", vllm),
            "--num-speculative-tokens": f"is vLLM's name for --gamma here ({gamma})",
            **{name: f"is llama.cpp's name for --gamma here ({gamma})" for name in LLAMA_CPP_DRAFT_MAX}}


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="specbuild")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")  # main() reads it
def cli(debug: bool) -> None:
    """Compile a draft/target pair of Hugging Face checkpoints into a speculative-decoding bundle, and run it."""
    if os.environ.get("NO_COLOR"):  # https://no-color.org, which click does not read: demo's completion was green
        click.get_current_context().color = False


@cli.command("compile", foreign=COMPILE_FOREIGN)
@click.option("--target", type=folder_path, help="Target checkpoint folder (config.json, *.safetensors, tokenizer).")
@click.option("--draft", type=folder_path, help="Draft checkpoint folder; must share the target's tokenizer (a draft "
              "without tokenizer files speaks the target's).")
@click.option("--output", "-o", type=folder_path, help="Bundle folder to write (written atomically).")
@click.option("--gamma", type=Setting("gamma"), help=f"Most draft tokens per round when the runtime adapts γ (1 to {MAX_GAMMA}).  [default: {DEFAULT_GAMMA}]")
@click.option("--max-seq-len", type=Setting("max_seq_len"), help=f"Context length the KV cache is allocated for.  [default: min({DEFAULT_MAX_SEQ_LEN}, the longest the pair takes)]")
@click.option("--recipe", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="TOML recipe with these settings; options override it.")
@click.option("--quantize", type=click.Choice(QUANTIZATIONS), help="Weight quantization of both engines.  [default: none]")
@click.option("--target-quantize", type=click.Choice(QUANTIZATIONS), help="Override --quantize for the target.")
@click.option("--draft-quantize", type=click.Choice(QUANTIZATIONS), help="Override --quantize for the draft.")
@click.option("--block-size", type=Setting("block_size"), help=f"Quantization block size of the ONNX engines along the input dimension (a power of two from 16 to 256; needs --quantize).  [default: {DEFAULT_BLOCK_SIZE}]")
@click.option("--accuracy-level", type=Setting("accuracy_level"),
              help="MatMulNBits compute type of quantized ONNX engines (needs --quantize), 0 to 4: 4 = int8 compute (fast on CPU), 0 or 1 = fp32, "
                   "2 = fp16, 3 = bf16. "
                   f"Each keeps speculative output identical to the target's own.  [default: {DEFAULT_ACCURACY_LEVEL}]")
@click.option("--precision", type=Precision(), help="Float type of the engines (fp16/bf16 for GPU).  [default: fp32]")
@click.option("--quality-report/--no-quality-report", default=None, help="Measure quantized ONNX engines against fp32 into the manifest (needs --quantize).  [default: on]")
@click.option("--overwrite/--no-overwrite", default=None,
              help="Replace the bundle at --output (never anything that is not a bundle); --no-overwrite undoes a recipe's.")
@click.option("--backend", type=click.Choice(BACKENDS),
              help="ONNX engines for this runtime, TensorRT-LLM checkpoints with build/run/serve plans (only the "
              "serve plans for a family without checkpoints: docs/tensorrt-llm.md), or both.  [default: onnx]")
@click.option("--tp", type=Setting("tp"), help="Tensor-parallel ranks of the TensorRT-LLM checkpoints (GPUs per engine).  [default: 1]")
@click.option("--json", "as_json", is_flag=True,
              help="Print the written bundle's manifest as JSON (what inspect --json prints) instead of the summary. "
                   "How to print, not a build setting: no recipe key.")
def compile_cmd(recipe, as_json, **options) -> None:
    """Build an engine bundle: both models as ONNX (the drafts' verification, greedy or sampled, inside the
    target's graph), and/or as TensorRT-LLM checkpoints with the plans to build and serve them.

    Give --target, --draft and --output, or a --recipe that names them."""
    from specbuild_runtime.manifest import where_it_runs

    from .errors import SettingsError
    from .recipe import resolve_settings
    from .staging import nothing_written, resolved

    try:
        settings = resolve_settings(recipe, **options)
    except SettingsError as exc:
        # Without a recipe, a setting missing or in conflict is the command line's alone (exit 2, as every command's
        # options in conflict); with one, the recipe takes part: an input that is wrong (exit 1)
        if recipe is None:
            raise click.UsageError(str(exc)) from None
        raise
    try:
        # torch and transformers load here (seconds on a busy machine), before staging can say what an interrupt
        # left at the output: a Ctrl-C then said "interrupted" alone
        from .compile import compile_bundle

        use_threads(None, torch_too=True)  # TensorRT-LLM's α for γ is measured in transformers
    except KeyboardInterrupt:
        raise nothing_written(resolved(settings.output)) from None
    manifest = compile_bundle(settings)
    done()
    if as_json:
        click.echo(manifest.to_json())
        return
    gamma = f"max gamma {manifest.gamma}, " if manifest.engines else ""  # TensorRT-LLM alone: its plans' draft length, below
    click.echo(f"wrote {settings.output}: {gamma}max-seq-len {manifest.max_seq_len}")
    for role, e in manifest.engines.items():
        click.echo(f"  {role} {e.architecture} {e.parameters / 1e6:.1f}M params, ONNX {e.precision} quant={e.quantization}")
    if manifest.engines:
        click.echo(f"  runs on: {where_it_runs(manifest)}")
        click.echo(f"  on cuda: {cuda_line(manifest)}")
    if manifest.tensorrt_llm:
        click.echo("  " + "\n  ".join(tensorrt_llm_lines(settings.output, manifest.tensorrt_llm)))


def cuda_line(manifest) -> str:
    """How the bundle's engines run on CUDA by default, with what to change for a GPU when they run badly there."""
    from specbuild_runtime.decode import uncaptured_because

    because = uncaptured_because(manifest)
    if not because:
        return "CUDA graphs by default with one slot (--no-cuda-graphs: uncaptured; serve --parallel 2+ leaves them off)"
    advice = "; for a GPU compile with --precision fp16 or bf16" if "fp32" in because else ""
    return f"uncaptured by default: {because}{advice}"


@cli.command(foreign=decoding_foreign("generate"))
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompt", "-p", required=True, type=PromptText(), help="Text to continue; - reads it from stdin.")
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=128, show_default=True, help="Stop after this many new tokens.")
@gamma_option
@click.option("--chat", is_flag=True, help="Send the prompt as a user message in the bundle's chat template (as serve's "
              "/v1/chat/completions renders it) and print the reply alone.")
@chat_template_option
@stop_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, ids, stats) instead of streaming text.")
@click.option("--logprobs", type=click.IntRange(0, MAX_LOGPROBS), metavar="N",
              help="With --json: each token's logprob under the target and the N most probable tokens' (as the API's "
                   "logprobs; -inf written -9999.0).")
@decoding_options
@click.option("--json-schema", type=TextOrFile(as_json=True),
              help="Output only JSON this schema allows (JSON text, or @FILE), as vLLM's structured_outputs json.")
@click.option("--regex", help="Output only text this regular expression matches, as vLLM's structured_outputs regex.")
@click.option("--choice", multiple=True, metavar="TEXT",
              help="Output exactly one of these texts (repeatable), as vLLM's structured_outputs choice.")
@click.option("--grammar", type=TextOrFile(),
              help="Output only what this Lark or GBNF grammar allows (text, or @FILE), as vLLM's structured_outputs "
                   "grammar.")
def generate(bundle, prompt, max_new_tokens, gamma, chat, chat_template, stop, as_json, logprobs, device, cuda_graphs,
             draft_steps, threads, json_schema, regex, choice, grammar, **sampling) -> None:
    """Continue a prompt with speculative decoding (greedy, or sampling with --temperature)."""
    from specbuild_runtime import SpeculativeDecoder, Stats

    check_sampling(sampling)
    check_min_tokens(sampling["min_tokens"], max_new_tokens)
    if structured := structured_outputs({"json": json_schema, "regex": regex, "choice": list(choice) or None,
                                         "grammar": grammar}):
        sampling["structured_outputs"] = structured
    if chat_template is not None and not chat:  # a plain prompt renders no template: it would be ignored
        raise click.UsageError("--chat-template applies to --chat: give --chat too")
    if logprobs is not None and not as_json:
        raise click.UsageError("--logprobs are printed in --json output: give --json too")
    use_threads(threads)
    decoder = SpeculativeDecoder(bundle, device=device, shared_thread_pool=True, cuda_graphs=cuda_graphs,
                                 draft_steps=draft_steps)
    shown = prompt
    if chat:
        prompt, shown = chat_prompt(decoder, prompt, chat_template, max_new_tokens), ""
    if as_json:
        result = decoder.generate(prompt, max_new_tokens, gamma, stop=list(stop), logprobs=logprobs, **sampling)
        records = {} if logprobs is None else {"logprobs": [
            {"token_id": r.token_id, "logprob": floored(r.logprob),
             "top": [[token, floored(logprob)] for token, logprob in r.top]} for r in result.logprobs]}
        click.echo(json.dumps({
            "text": result.text,
            "token_ids": result.token_ids,
            "prompt_token_ids": result.prompt_token_ids,
            "gamma": gamma,
            **records,
            "stats": result.stats.to_dict(),
        }))
        return
    stats = Stats()
    deltas = decoder.stream_text(prompt, max_new_tokens, gamma, stop=list(stop), stats=stats, **sampling)  # checks the request
    click.echo(shown, nl=False)
    try:
        for delta in deltas:
            click.echo(delta, nl=False)
    finally:  # a decode that fails mid-way (an fp16 overflow, Ctrl-C): its error begins a line of its own
        click.echo()
    click.echo(_stats_line(stats, gamma, decoder.max_seq_len), err=True)


def chat_prompt(decoder, text: str, supplied, max_new_tokens: int) -> list[int]:
    """text as one user message in the bundle's chat template (or the one supplied, --chat-template), as token ids;
    refused before tokenizing where it cannot fit the context with max_new_tokens, as a text prompt is."""
    from .chat import load_template

    template = load_template(decoder, supplied, ", or the prompt as text, without --chat")
    return template.prompt_ids(decoder.tokenizer, [{"role": "user", "content": text}], decoder.fits(max_new_tokens))


def _token(token: int | None) -> str:
    return "(output ended)" if token is None else str(token)


def _stats_line(stats, gamma, context: int) -> str:
    s = stats.to_dict()
    line = f"{s['generated_tokens']} tokens, {s['tokens_per_second']:.1f} tok/s, ttft {s['ttft_ms']:.1f} ms"
    guesses = (f"{count(stats.guesses_accepted, 'token')} from free guesses in {count(stats.guessed, 'round')}"
               if stats.guessed else "")
    if stats.drafted:
        line += f", gamma {gamma}, acceptance {s['acceptance_rate']:.2f}, {s['mean_accepted_tokens']:.2f} tokens/round"
        line += f" ({guesses})" if guesses else ""
    elif stats.rounds and gamma == "auto":  # said nothing of γ: auto read as broken, or as never tried
        line += (f", gamma auto drafted nothing: decoded target-only{f', {guesses}' if guesses else ''}, "
                 f"{s['mean_accepted_tokens']:.2f} tokens/round")
    if stats.finish_reason == "context":  # fewer tokens than -n asked for, with no word why, read as a failure
        line += f"; stopped: the bundle's context ({context} tokens) is full (compile's --max-seq-len)"
    return line


def quantized_line(engine: Path) -> str:
    """How a quantized engine's MatMulNBits nodes are set (read from its graph, not its weights: the
    manifest does not record them)."""
    import onnx

    graph = onnx.load(str(engine), load_external_data=False).graph
    settings = {(attr["bits"], attr["block_size"], attr.get("accuracy_level", 0))
                for node in graph.node if node.op_type == "MatMulNBits"
                for attr in [{a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}]}
    return "MatMulNBits " + "; ".join(f"{bits}-bit, block size {block}, accuracy level {level}"
                                      for bits, block, level in sorted(settings)) if settings else "no MatMulNBits node"


def sampler_inputs(bundle: Path, manifest) -> set[str]:
    """The inputs of the bundle's sampler, compiled with the engines: whether they take min_p and the penalties, as
    serve tells from the engines (SpeculativeDecoder.has_min_p, has_penalties). A bundle without a sampler was
    compiled before both."""
    import onnx

    if not manifest.sampler_file:
        return set()
    graph = onnx.load(str(bundle / manifest.sampler_file), load_external_data=False).graph
    return {value.name for value in graph.input}


def features_line(bundle: Path, manifest, sampler: set[str]) -> str:
    """Which request options that need a graph input the bundle's engines take (decode.request_features), told from
    the names of their graphs' inputs and outputs as the runtime tells them, without loading weights: an option counts
    where every graph a decoder may decide with takes it (the engine graph; where the bundle has them, the greedy-only
    graph, sampled by the sampler, whose inputs are sampler)."""
    import onnx

    from specbuild_runtime.decode import request_features
    from specbuild_runtime.engine import Takes, graph_takes

    def takes(file: str, sampling: set[str] | None) -> Takes:
        graph = onnx.load(str(bundle / file), load_external_data=False).graph
        inputs = {value.name for value in graph.input}
        return graph_takes(inputs, {value.name for value in graph.output}, inputs if sampling is None else sampling,
                           greedy_only=sampling is not None)

    def engine(info) -> Takes:
        each = [takes(info.file, None)] + ([takes(info.greedy_file, sampler)] if manifest.has_greedy_graphs else [])
        return Takes(*map(all, zip(*each)))

    features = request_features(engine(manifest.engines["target"]), engine(manifest.engines["draft"]))
    line = "take " + (", ".join(name for name, taken in features.items() if taken) or "none")
    if lacking := [name for name, taken in features.items() if not taken]:
        line += f"; not {', '.join(lacking)} (compiled before them: recompile with `specbuild compile` to have them)"
    return line


@cli.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def inspect(bundle, as_json) -> None:
    """Show what a bundle holds: engines, shapes, settings, and whether its files are intact."""
    from specbuild_runtime.manifest import (TOKENIZER_DIR, chat_template_source, load_manifest, read_tokenizer_config,
                                            where_it_runs)
    from specbuild_runtime.serve.protocol import sampling_defaults
    from specbuild_runtime.validation import MIN_P, PENALTY_INPUTS

    manifest = load_manifest(bundle)
    if as_json:
        click.echo(manifest.to_json())
        return
    click.echo(f"bundle     {bundle}  (format v{manifest.format_version}, {manifest.created_by}, files intact)")
    gamma = f"max gamma  {manifest.gamma} (adaptive)   " if manifest.engines else ""  # TensorRT-LLM: its plans' draft length
    longest = f" (of up to {manifest.context_limit})" if manifest.context_limit else ""  # older bundles do not say
    click.echo(f"{gamma}max-seq-len {manifest.max_seq_len}{longest}   eos {manifest.eos_token_ids}")
    if manifest.build:
        click.echo(f"compiled   in {manifest.build['seconds']:.0f} s, peak memory {manifest.build['peak_rss_bytes'] / 2**30:.2f} GiB")
    for role, e in sorted(manifest.engines.items(), key=lambda item: item[0] != "target"):  # the target first
        s = e.shape
        click.echo(
            f"{role:<10} {e.architecture} {e.parameters / 1e6:.2f}M params, {e.weight_bytes / 2**20:.1f} MiB, "
            f"{e.backend} {e.precision} (from {e.source_dtype or '?'}) quant={e.quantization}; layers {s.num_layers}, hidden {s.hidden_size}, "
            f"heads {s.num_heads}/{s.num_kv_heads} kv, vocab {s.vocab_size}"
        )
        click.echo(f"{'':<10} from {e.source['path']} (sha256 {e.source['sha256'][:12]}…)")
        click.echo(f"{'':<10} graphs {e.file}" + (f" and {e.greedy_file} (greedy-only, for CUDA graphs)" if e.greedy_file
                                                   else " (no greedy-only graph: compiled before them)")
                   + (f"; {e.steps_file} (drafting several tokens a call)" if e.steps_file else ""))
        if e.rope_switch_length:
            click.echo(f"{'':<10} rotary: LongRoPE short factors up to {e.rope_switch_length} tokens, long ones past it "
                       "(a sequence that crosses it re-feeds its cache once)")
        if e.not_finite_token is None:
            click.echo(f"{'':<10} made before the non-finite check: NaN or infinite logits (an fp16 overflow) pass as "
                       "token 0; recompile to have them caught")
        if e.quantization != "none":
            click.echo(f"{'':<10} {quantized_line(bundle / e.file)}")
        if e.quality:
            click.echo(f"{'':<10} quality vs fp32: {quality_line(e.quality)}")
    if manifest.engines:
        click.echo(f"{'sampler':<10} " + (f"{manifest.sampler_file} (how the greedy-only graphs sample)" if manifest.sampler_file
                                          else "none: compiled before it (CUDA graphs need a recompile)"))
        click.echo(f"{'runs on':<10} {where_it_runs(manifest)}")
        click.echo(f"{'on cuda':<10} {cuda_line(manifest)}")
        taken = sampler_inputs(bundle, manifest)
        defaults = sampling_defaults(manifest.generation_config, "auto", MIN_P in taken, PENALTY_INPUTS.keys() <= taken)
        click.echo(f"{'serve':<10} by default (--generation-config auto), {defaults}")
        click.echo(f"{'requests':<10} {features_line(bundle, manifest, taken)}")
    if manifest.tensorrt_llm:
        click.echo("\n".join(f"{'tensorrt':<10} {line}" for line in tensorrt_llm_lines(bundle, manifest.tensorrt_llm)))
    config = read_tokenizer_config(bundle / TOKENIZER_DIR)
    found = chat_template_source(bundle / TOKENIZER_DIR, config if isinstance(config, dict) else {})
    click.echo(f"{'chat':<10} " + (f"template in {found[1]}" if found else
                                   "no template (serve and generate --chat need --chat-template)"))


def tensorrt_llm_lines(bundle: Path, part) -> list[str]:
    """The TensorRT-LLM part of a bundle, for people: checkpoints, measured γ, plans, engines."""
    g = part.gamma
    how = (f"alpha {g['alpha']:.2f}, cost ratio {g['cost_ratio']:.2f}, expected {g['expected_speedup']:.2f}x; {g['method']}"
           if g["alpha"] is not None else g["method"])  # unmeasured, the method says so and why
    # A family the export does not take: the checkpoints entries say why, and only serving plans were written.
    unexported = sorted(((role, c) for role, c in part.checkpoints.items() if "dir" not in c),
                        key=lambda item: (not item[1].get("not_exported"), item[0] != "target"))  # one that says why
    if unexported:
        role, c = unexported[0]
        plans = [Path(path).name for path in part.plans.values()]
        lines = [f"no TensorRT-LLM checkpoints ({role} {c['architecture']}: {c['not_exported']}); wrote "
                 f"{' and '.join(plans)}, which serve{'s' if len(plans) == 1 else ''} the source folders",
                 f"tp {part.tp_size}; draft length {g['gamma']} ({how})"]
    else:
        lines = [f"TensorRT-LLM checkpoints, tp {part.tp_size}; draft length {g['gamma']} ({how})"]
        for role, c in part.checkpoints.items():
            quant = f", {c['quant_algo']} at build" if c["quant_algo"] else ""
            lines.append(f"{role:<6} {c['dir']}/: {c['architecture']} {c['dtype']}{quant}, "
                         f"{c['parameters'] / 1e6:.2f}M params, vocab {c['vocab_size']} (lm_head {c['lm_head_rows']} "
                         f"rows), {len(c['ranks'])} rank file(s)")
    if g["expected_speedup"] is not None and g["expected_speedup"] < 1:
        lines.append("speculation is not expected to pay on this pair (expected speed-up below 1)")
    lines.append("plans  " + ", ".join(str(Path(bundle) / path) for path in part.plans.values()))
    if "build" in part.plans:
        build = Path(bundle) / part.plans["build"]
        lines.append(f"engines {Path(bundle) / part.engines}" if part.engines else
                     f"engines not built here (no trtllm-build on PATH): run {build} on a GPU machine")
    return lines


def quality_line(q: dict) -> str:
    if "skipped" in q:
        return f"not measured: {q['skipped']}"
    parts = [f"size {q['size_ratio']:.0%}", f"perplexity {q['quant']['perplexity']:.2f} vs {q['fp32']['perplexity']:.2f}"]
    # A context shorter than every measuring prompt leaves nothing decoded: the report holds None there.
    if q["greedy_agreement"] is None:
        parts.append("greedy agreement and speed not measured: no measuring prompt fits the context")
    else:
        agreement = f"greedy agreement {q['greedy_agreement']:.1%} ({q['greedy_identical_prompts']}/{q['prompts']} prompts identical"
        if q.get("teacher_forced_agreement") is not None:
            agreement += f"; {q['teacher_forced_agreement']:.1%} teacher-forced"
        parts += [agreement + ")", f"{q['quant']['tokens_per_second']:.0f} vs {q['fp32']['tokens_per_second']:.0f} tok/s"]
    alpha = q.get("alpha", {})
    if "skipped" in alpha:
        parts.append(f"α not measured: {alpha['skipped']}")
    elif alpha and None in (alpha["quant"], alpha["fp32"]):
        parts.append("α not measured: no measuring prompt leaves room to draft")
    elif alpha:
        parts.append(f"α at γ={alpha['gamma']} {alpha['quant']:.2f} vs {alpha['fp32']:.2f}")
    return ", ".join(parts)


@cli.command(foreign=decoding_foreign("verify"))
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--target", type=folder_path, help="The target checkpoint the bundle was built from.  [default: the folder "
              "the manifest records, if its files are unchanged]")
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help='JSONL file, one {"prompt": "..."} per line.  [default: the bundled code prompts, as bench\'s]')
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=64, show_default=True,
              help="Tokens compared per prompt.")
@click.option("--gamma", type=GammaType(), default="auto", show_default=True, help="Draft tokens per round.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@device_option
@cuda_graphs_option
@draft_steps_option
@threads_option(EVERY_CORE, "onnxruntime threads per engine call, and torch's for transformers")
def verify(bundle, target, prompts, max_new_tokens, gamma, as_json, device, cuda_graphs, draft_steps, threads) -> None:
    """Gate a bundle: its greedy output must equal transformers' on every prompt (exit 1 if not).

    transformers runs on the same device, in the target engine's float type. The defaults compare 24 prompts × 64
    tokens: 80 s for the demo pair on two busy cores, where transformers takes most; --prompts (a file of fewer
    prompts) and -n shorten it."""
    from .texts import CODE_PROMPTS
    from .verify import verify_bundle

    use_threads(threads, torch_too=True)
    report = verify_bundle(bundle, target, prompts or CODE_PROMPTS, max_new_tokens, gamma, device, cuda_graphs,
                           draft_steps)
    if as_json:
        click.echo(json.dumps(report))
    elif report["identical"]:
        click.echo(f"identical: {count(report['prompts'], 'prompt')}, {count(report['tokens'], 'token')} match "
                   f"transformers ({report['precision']} on {report['device']})")
    else:
        divergences, precision = report["divergences"], report["precision"]
        d = divergences[0]
        others = (f" (and {len(divergences) - 1} more of {count(report['prompts'], 'prompt')})"
                  if len(divergences) > 1 else "")
        line = (f"DIVERGED on prompt {d['prompt_index'] + 1} ({d['prompt'][:40]!r}) at generated token {d['position']}{others}: "
                f"bundle {_token(d['bundle_token'])} vs transformers {_token(d['transformers_token'])} "
                f"({precision} on {report['device']})")
        if "transformers_vs_fp32" in d:
            def at(key):
                return ", ".join("never" if each[key] is None else str(each[key]) for each in divergences)
            line += (f"; against transformers fp32 the bundle diverges at token {at('bundle_vs_fp32')}, transformers "
                     f"{precision} itself at {at('transformers_vs_fp32')}, prompt by prompt "
                     "(alike and late: rounding; early: a bug)")
        click.echo(line)
    if not report["identical"] and report["quantization"] != "none" and not as_json:
        from specbuild_runtime.manifest import load_manifest

        # Compile measures only targets up to ~64M parameters: above, pointing at inspect found "not measured".
        quality = load_manifest(bundle, check_digests=False).engines["target"].quality
        measured = ("compile measured how far (specbuild inspect: quality)" if quality and "skipped" not in quality else
                    f"compile did not measure how far ({quality.get('skipped', 'compiled with --no-quality-report')})")
        click.echo(f"note: the target engine is {report['quantization']}-quantized and transformers runs the checkpoint's "
                   f"own weights, so divergence is expected; {measured}", err=True)
    if not report["same_source"] and not as_json:
        click.echo(f"note: {target} is not the checkpoint the bundle was compiled from (their sha256 differ)", err=True)
    if not report["identical"]:
        sys.exit(1)


# bench's --gamma is a list of fixed γ: auto is measured beside them, never given.
@cli.command(foreign=decoding_foreign("bench", "the fixed drafts per round to measure beside auto, comma-separated"))
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help='JSONL file, one {"prompt": "..."} per line.  [default: the bundled code prompts]')
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=2), default=128, show_default=True,
              help="Tokens per prompt (at least 2: decode speed is measured after the first).")
# No fixed γ leaves the draft's step cost, the theoretical bound and the peers' speculative rows unmeasured:
# an empty list (an unset variable in a script) is a slip, and ran quietly without them.
@click.option("--gamma", "gammas", type=CommaList(click.IntRange(1, MAX_GAMMA), empty=f"give at least one γ from 1 to "
                                                                                     f"{MAX_GAMMA}, e.g. {BENCH_GAMMAS}"),
              default=BENCH_GAMMAS, show_default=True,
              help="Comma-separated fixed γ values (at least one, up to the bundle's max gamma) to measure beside "
                   "target-only and auto; the default stops at the bundle's max gamma.")
@click.option("--peers", type=CommaList(click.Choice(PEERS)), default="",
              help=f"Comma-separated peers to measure on the source checkpoints: {', '.join(PEERS)}.")
@click.option("--json", "json_out", is_flag=False, flag_value="-", metavar="[FILE]",
              type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
              help="Print the full report as JSON instead of the table; with a FILE, write it there beside the table.")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False, path_type=Path), help="Write a plot here: PNG, SVG or PDF by the name's extension (needs matplotlib).")
@sampling_options(temperature_help="Sample at this temperature instead of greedy decoding (auto γ unseeded, as most "
                                   "traffic is).",
                  seed_help="Sampled fixed-γ rows seed prompt i with SEED + i, so every mode samples the same way "
                            "(-1: unseeded, as auto).",
                  seed_default=0)
@device_option
@cuda_graphs_option
@draft_steps_option
@threads_option(EVERY_CORE, "onnxruntime threads per engine call, and torch's for the transformers peer")
def bench(bundle, prompts, max_new_tokens, gammas, peers, json_out, plot_out, device, cuda_graphs, draft_steps, threads,
          seed, **sampling) -> None:
    """Measure speculative vs target-only decoding (and peers) side by side, with the theoretical bound.

    Every mode (target-only, each --gamma, auto) decodes every prompt for -n tokens, taking turns prompt by prompt,
    after a warm-up of one prompt in each; then the target alone times 400 calls at two contexts, and each peer
    decodes the prompts. The defaults decode 24 prompts × 128 tokens in 6 modes: an hour or more of a CPU at 0.6B.
    After the warm-up, a run of a minute or more says how long it will decode; --prompts (a file of fewer prompts),
    -n and --gamma shorten it."""
    from .bench import bench as benchmark
    from .texts import CODE_PROMPTS, read_prompts

    to_stdout = json_out == Path("-")
    # Refused now rather than after minutes of measuring.
    writable_file(None if to_stdout else json_out, "--json")
    writable_file(plot_out, "--plot")
    if plot_out:
        check_plot_path(plot_out)
    check_sampling(sampling)
    if threads and (own := [peer for peer in peers if peer != "transformers"]):
        # Their rows would be timed on every core beside rows held to --threads: a comparison that misleads.
        raise click.UsageError(f"--threads bounds specbuild's and transformers' threads, not {' or '.join(own)}'s, "
                               "which would be timed on every core: leave out --threads or those peers")
    use_threads(threads, torch_too="transformers" in peers)
    if click.get_current_context().get_parameter_source("gammas") is click.core.ParameterSource.DEFAULT:
        gammas = None  # DEFAULT_GAMMAS up to what the bundle allows, which its manifest says
    report = benchmark.bench(bundle, read_prompts(prompts or CODE_PROMPTS), max_new_tokens, gammas, peers, sampling,
                             device, cuda_graphs, draft_steps, seed)
    # The files first: a reader gone from stdout (`| true`, a `head` done early) ends the command at the table,
    # which lost minutes of measuring when they came after it.
    if json_out and not to_stdout:
        replace_file(json_out, json.dumps(report, indent=2))  # a kill mid-write leaves the last report whole
    if plot_out:
        benchmark.plot(report, plot_out)
    if to_stdout:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(benchmark.format_table(report))


def writable_file(path: Path | None, option: str) -> None:
    """A usage error unless a file can be written at path (its folder exists and is writable, and it is
    not a folder itself)."""
    if path is None:
        return
    if path.is_dir():
        raise click.BadParameter(f"{path} is a folder; give a file name", param_hint=option)
    if not path.parent.is_dir():
        raise click.BadParameter(f"folder {path.parent} does not exist; create it or write elsewhere", param_hint=option)
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise click.BadParameter(f"{path} cannot be written (permission denied); write elsewhere", param_hint=option)


def check_plot_path(path: Path) -> None:
    """An error unless matplotlib is installed and a usage error unless it writes the format path's suffix names."""
    try:
        from matplotlib.figure import Figure
    except ImportError:  # the installation lacks it, not the command line (exit 1, as serve without its extra)
        raise click.ClickException("--plot needs matplotlib: pip install matplotlib") from None
    formats = Figure().canvas.get_supported_filetypes()
    if path.suffix.lstrip(".").lower() not in formats:
        raise click.BadParameter(f"{path} does not end in a format matplotlib writes ({', '.join('.' + f for f in sorted(formats))})",
                                 param_hint="--plot")


def alpha_digits(*values: float) -> int:
    """Decimals to print distill's α values at: 3, or the report's 4 where 3 show two that differ as one (a draft is
    written on any rise: "α 0.001 -> 0.001 (+0.000)" was followed by "wrote")."""
    return 3 if len({f"{value:.3f}" for value in values}) == len(set(values)) else 4


# click answered distill --dtype with "Did you mean '--data'?"
@cli.command(foreign={"--dtype": "is not distill's: it holds the target and trains and writes the draft in fp32; the "
                                 "bundle's float type is compile's --precision"})
@click.option("--target", required=True, type=folder_path, help="Target checkpoint folder (any supported architecture).")
@click.option("--output", "-o", required=True, type=folder_path, help="Where to write the draft checkpoint (atomically).")
@click.option("--init", type=folder_path, help="Start from this draft checkpoint (the target's tokenizer, or no tokenizer "
              "files) instead of a new one of --draft-config.")
@click.option("--draft-config", "draft_config", type=KeyValue(), multiple=True,
              help="Config overrides for a new draft, e.g. num_hidden_layers=2 (repeatable).  [default: of the "
                   "target's model_type (a mixture of experts': its dense sibling's), of at most 1/10 of its "
                   "parameters; for a target too small for that (a draft keeps the vocabulary and at least 64 of "
                   "width), the smallest shape, a larger share (distill prints it)]")
@click.option("--minutes", type=Setting("minutes", DISTILL_RULES, click.FLOAT), default=DISTILL_MINUTES, show_default=True,
              help="Time for making data and training (measuring α before and after comes on top).")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help='JSONL prompts, one {"prompt": "..."} per line, as you will decode (a fourth are held out to measure α).')
@click.option("--data", type=click.Path(exists=True, path_type=Path),
              help="Text file or folder whose spans serve as prompts, instead of --prompts.  [default (neither): the "
                   "target's own samples]")
@click.option("--gamma", type=Setting("gamma", DISTILL_RULES), default=DISTILL_GAMMA, show_default=True,
              help=f"γ at which acceptance is measured (1 to {MAX_GAMMA}).")
@click.option("--loss", "objective", type=click.Choice(DISTILL_OBJECTIVES), default=DISTILL_OBJECTIVE,
              show_default=True, help="Divergence of the draft's distribution from the target's: total variation, "
                                      "forward or reverse KL, Jensen-Shannon.")
@click.option("--batch-size", type=Setting("batch_size", DISTILL_RULES), default=DISTILL_BATCH_SIZE, show_default=True,
              help="Sequences per training step: a smaller batch holds less of the draft's training in memory and "
                   "trains more slowly (the target's fp32 weights need the same either way).")
@click.option("--seed", type=Setting("seed", DISTILL_RULES), default=DISTILL_SEED, show_default=True,
              help=f"Seed, a whole number from 0 to {MAX_SEED}, for a new draft's weights, the prompts made or picked "
                   "and held out, and training's batches (training stops at --minutes of wall-clock time, so runs "
                   "differ in how far they get).")
@click.option("--force", is_flag=True, help="Write the draft even if α did not rise.")
@click.option("--overwrite", is_flag=True, help="Replace the checkpoint at --output (never anything that is not a checkpoint).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def distill(target, output, init, draft_config, minutes, prompts_file, data, gamma, objective, batch_size, seed, force,
            overwrite, as_json) -> None:
    """Train a draft on what the target writes, so that it agrees with the target more often.

    The target continues prompts (yours, spans of your text, or its own samples); the draft learns the
    target's distribution at every token. The output is written only if α on held-out prompts rose."""
    options = {param.name: param.opts[0] for param in click.get_current_context().command.params}
    if problem := distill_conflict(dict(init=init, draft_config=draft_config, prompts_file=prompts_file, data=data),
                                   options.__getitem__):
        raise click.UsageError(problem)
    from .errors import TrainingError
    from .train.distill import distill as run_distill

    use_threads(None, torch_too=True)  # the target generates and the draft trains in torch
    overrides = dict(draft_config) or None
    report = run_distill(target, output, draft_config=overrides, init=init, minutes=minutes, prompts_file=prompts_file,
                         data=data, gamma=gamma, objective=objective, batch_size=batch_size, seed=seed, force=force,
                         overwrite=overwrite)
    done()
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        made = report["generation"]
        if prompts_file or data:
            click.echo(f"prompts: {report['prompts']} ({report['train_prompts']} for training, {report['heldout_prompts']} "
                       "held out)")
        else:
            click.echo(f"prompts: the target's own samples from its start token ({report['heldout_prompts']} held out)")
        d = alpha_digits(report["alpha_before"], report["alpha_after"])
        click.echo(
            f"acceptance α at γ {gamma} on the held-out prompts: {report['alpha_before']:.{d}f} -> "
            f"{report['alpha_after']:.{d}f} ({report['alpha_gain']:+.{d}f}) after "
            f"{report['training']['seconds'] / 60:.1f} min "
            f"({count(made['sequences'], 'sequence')} made in {made['seconds'] / 60:.1f} min, "
            f"{count(report['training']['steps'], 'step')})"
        )
        click.echo(
            f"speed-up bound at γ {gamma} with c = {report['cost_ratio']:.3f} (draft/target parameters): "
            f"{report['theoretical_speedup_before']:.2f}x -> {report['theoretical_speedup_after']:.2f}x"
        )
        if report["written"]:
            click.echo(f"wrote {output}: draft {report['draft_parameters'] / 1e6:.2f}M parameters "
                       f"({report['draft_parameters'] / report['target_parameters']:.1%} of the target)")
    if not report["written"]:
        more = "more prompts like yours" if prompts_file or data else "--prompts like yours"
        replaced = report["alpha_replaced"]
        d = alpha_digits(*(value for value in (report["alpha_before"], report["alpha_after"], replaced)
                           if value is not None))
        rise = f"{report['alpha_before']:.{d}f} -> {report['alpha_after']:.{d}f}"
        why = (f"α rose ({rise}) but not above the {replaced:.{d}f} of the draft at {output}, so it was not replaced"
               if replaced is not None and report["alpha_after"] > report["alpha_before"] else
               f"α did not rise ({rise}), so {output} was not written")
        raise TrainingError(f"{why}; train longer, give {more}, or --force to write it anyway")


@cli.command()
@click.option("--cache", type=folder_path, default=Path(".cache/demo"), show_default=True,
              help="Where the demo pair and its bundle are kept between runs.")
@click.option("--recipe", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="Recipe with the pair's [pair] and [compile] tables.  [default: the packaged specbuild/recipes/demo.toml]")
@click.option("--prompt", "-p", type=PromptText(),
              help="Code to complete (the speed-up is then measured on it alone); - reads it from stdin.  "
                   "[default: 8 bundled code prompts, all measured, the first shown]")
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=2), default=96, show_default=True,
              help="Tokens to generate per prompt (at least 2: decode speed is measured after the first).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def demo(cache, recipe, prompt, max_new_tokens, as_json) -> None:
    """Make (once) a small real code-model pair, compile it, and show speculation beating the target alone."""
    from .demo import DEMO_RECIPE, run_demo

    summary = run_demo(cache, recipe or DEMO_RECIPE, prompt, max_new_tokens)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    completion = summary["completion"]
    if completion.strip():
        click.echo(summary["prompt"] + click.style(completion, fg="green"))
    else:  # a screen of nothing looks like a hang or a bug; say what it is
        click.echo(summary["prompt"] + click.style(f"[{len(completion)} whitespace characters]", fg="green"))
        click.echo("(the demo target, trained for minutes on 2 cores, often completes with blank lines; try --prompt)")
    click.echo("-" * 60)
    # A short run (-n 4) may end before auto drafts at all: no α to give, which 0 would misstate.
    alpha = summary["acceptance_rate"]
    click.echo(
        ("auto drafted nothing (target-only, with free guesses)" if alpha is None else f"acceptance α {alpha:.2f}")
        + f", {summary['mean_accepted_tokens']:.2f} tokens per target call (adaptive γ), over "
        f"{count(summary['prompts'], 'prompt')}"
    )
    click.echo(
        f"target only {summary['target_only_tokens_per_second']:.0f} tok/s -> speculative "
        f"{summary['speculative_tokens_per_second']:.0f} tok/s: {summary['speedup']:.2f}x, output "
        + ("identical to the target's" if summary["identical_to_target"] else "DIFFERENT from the target's (a bug)")
    )


@cli.command(foreign=decoding_foreign("chat"))
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--system", metavar="TEXT", help="Begin each conversation with this system message.")
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=512, show_default=True,
              help="Stop each reply after this many tokens.")
@gamma_option
@chat_template_option
@stop_option
@click.option("--stats", "show_stats", is_flag=True, help="After each reply, print its stats line on stderr, with the "
              "prompt tokens the cache held from the turns before.")
@decoding_options
def chat(bundle, system, max_new_tokens, gamma, chat_template, stop, show_stats, device, cuda_graphs, draft_steps,
         threads, **sampling) -> None:
    """Talk with a bundle: each line on stdin is your turn, the reply streams as it decodes.

    The whole conversation is rendered with the bundle's chat template each turn (the cache holds the turns before
    where their text tokenizes as it was decoded). /reset starts a new conversation; /exit, Ctrl-D or Ctrl-C at the
    prompt ends; Ctrl-C during a reply stops it, as a --stop string does."""
    from specbuild_runtime import SpeculativeDecoder

    from .chat import converse, load_template

    check_sampling(sampling)
    check_min_tokens(sampling["min_tokens"], max_new_tokens)
    if system is not None:
        try:
            system.encode("utf-8")
        except UnicodeEncodeError:  # undecodable argv bytes, as PromptText refuses them in --prompt
            raise click.BadParameter("is not valid UTF-8 text", param_hint="'--system'") from None
    use_threads(threads)
    decoder = SpeculativeDecoder(bundle, device=device, shared_thread_pool=True, cuda_graphs=cuda_graphs,
                                 draft_steps=draft_steps)
    template = load_template(decoder, chat_template, "")

    def stats_line(stats) -> str:
        return (f"prompt {stats.prompt_tokens} tokens ({stats.cached_prompt_tokens} cached), "
                + _stats_line(stats, gamma, decoder.max_seq_len))

    converse(decoder, template, system, max_new_tokens, gamma, stats_line if show_stats else None, stop=list(stop),
             **sampling)


cli.add_command(serve_command)  # defined in the runtime, which a torch-free service installs alone


def main(args: list[str] | None = None) -> None:
    """Run the CLI; every failure becomes one line on stderr and an exit status (see the module docstring)."""
    global _as_command
    _as_command = args is None
    args = sys.argv[1:] if args is None else list(args)
    status = run_command(cli, args, "specbuild", debug="--debug" in args,
                         bug_hint="rerun with `specbuild --debug ...` for the traceback and report it")
    done()
    sys.exit(status)


def done() -> None:
    """The command's folder is in place, or its outcome told: from here Ctrl-C, SIGTERM and SIGHUP are dropped.
    They reported "interrupted" (exit 130: nothing left behind) over a bundle already published, or, while the
    interpreter shut down (torch's and onnxruntime's finalizers: most of a second), printed a traceback
    ("Exception ignored in ... KeyboardInterrupt") or ended the process by the signal."""
    if _as_command:
        for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(number, signal.SIG_IGN)
