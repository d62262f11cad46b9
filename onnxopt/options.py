"""Options as objects: every setting of ``optimize()`` and ``quantize()``, declared once.

Design (issue 28, point 3):

- A concern is a frozen dataclass: :class:`TargetOptions` (where it runs, precision),
  :class:`RewriteOptions` (the rules and their limits), :class:`SaveOptions` (how the result is
  written), :class:`LayoutOptions` (the model's edges: input shapes, layouts, preprocessing),
  :class:`VerifyOptions`, :class:`ReportOptions`; :class:`OptimizeOptions` holds one of each.
  :class:`QuantizeOptions` is ``quantize()``'s.
- Each field is declared once, with :func:`option`: its default, and in its metadata an
  :class:`Option` with everything the other faces need: the command-line flag (flags, argparse
  arguments, help, group, which subcommands take it, companions such as ``--no-quiet``), the
  config-file key (kind, description, choices, minimum, path, the value's parser), how the flag's
  value becomes the field's (``from_cli``), and the API keyword it answers to.
- ``optimize(model, output, options=OptimizeOptions(...), **shortcuts)``: each old keyword is a
  shortcut for one field (:meth:`OptimizeOptions.with_shortcuts`); likewise ``quantize``.
- ``onnxopt.cli`` builds its parsers from :func:`flag_options` and its calls with
  :meth:`OptimizeOptions.from_args`; ``onnxopt.cli.config.SCHEMA`` is :func:`config_options` (in
  declaration order). A new option is one :func:`option` field here: it is then a flag, a config
  key and a keyword (tests/test_options.py shows it).

This module is a leaf of the API layer: it imports targets, ir, transforms.edges, verify and errors
(lazily quantize.calibrate and library.registry, for load time); never cli, api or quantize.api.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

from onnxopt import targets
from onnxopt import verify as verifier
from onnxopt.errors import UsageError
from onnxopt.ir import evaluate, genai
from onnxopt.ir import input_shapes as shapes
from onnxopt.transforms import edges as layouts

OPTIMIZE, VERIFY, BISECT, QUANTIZE = "optimize", "verify", "bisect", "quantize"
CONFIG_COMMANDS = (OPTIMIZE, QUANTIZE)  # the commands that read a config file (-c)
DEFAULT_FIDELITY_DB = 20.0
"""The default minimum output SQNR (dB) of the quantized model against the float one."""
DEFAULT_METHOD = "minmax"
# the calibration methods onnxopt.quantize.calibrate implements (it reads them from here: settings are declared once)
QUANTIZE_METHODS = ("minmax", "percentile", "entropy", "mse")
PADDING = ("any", "right", "none")  # where a decoder's attention_mask may hold zeros (LayoutOptions.padding)

_order = itertools.count()


@dataclasses.dataclass(frozen=True)
class Option:
    """What the faces need to know of one field (``field.metadata["option"]``).

    Command line: ``flags`` (none: API only), ``help`` (a text, or one per command),
    ``commands`` (the subcommands whose parser takes it), ``group`` (the argparse group's title;
    None: the parser's own options), ``argparse`` (add_argument's other arguments: type, metavar,
    action, default, dest, ...), ``also`` (companion flags: ``(flags, add_argument arguments)``,
    e.g. ``--no-quiet``), ``exclusive`` (the flag and its companions exclude each other),
    ``from_cli`` (the field's value from the parsed Namespace; default the dest's value).
    Config file: ``key`` (dotted; None: not in the file), ``kind``, ``about``, ``choices``,
    ``minimum``, ``path`` and ``check`` as ``onnxopt.cli.config.Key`` takes them; a key declared by
    two fields (``target`` of optimize and of quantize) is one key read by both commands.
    API: ``keyword`` (the ``optimize()``/``quantize()`` keyword; default the field's name; None:
    none of its own), ``validate`` (the value -> None, or a one-line UsageError)."""

    flags: tuple[str, ...] = ()
    help: str | Mapping[str, str] | None = None
    commands: tuple[str, ...] = (OPTIMIZE,)
    group: str | None = None
    argparse: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    also: tuple[tuple[tuple[str, ...], Mapping[str, Any]], ...] = ()
    exclusive: bool = False
    from_cli: Callable[[argparse.Namespace], Any] | None = None
    key: str | None = None
    kind: str = "string"
    about: str = ""
    choices: Callable[[], tuple] | None = None
    minimum: int | None = None
    path: bool = False
    check: Callable[[Any, str], Any] | None = None
    keyword: str | None = "="  # "=": the field's own name
    validate: Callable[[Any], None] | None = None
    order: int = dataclasses.field(default_factory=lambda: next(_order))

    @property
    def dest(self) -> str:
        """The argparse destination of the flag."""
        if "dest" in self.argparse:
            return self.argparse["dest"]
        long = next((f for f in self.flags if f.startswith("--")), self.flags[0])
        return long.lstrip("-").replace("-", "_")

    @property
    def dests(self) -> tuple[str, ...]:
        """The destinations the flag and its companions set (a config key sets them all)."""
        found = [self.dest] + [kw.get("dest", flags[-1].lstrip("-").replace("-", "_")) for flags, kw in self.also]
        return tuple(dict.fromkeys(found))

    @property
    def flag(self) -> str:
        """The flag a message names (the long one)."""
        return next((f for f in self.flags if f.startswith("--")), self.flags[0]) if self.flags else ""

    def help_for(self, command: str) -> str | None:
        return self.help.get(command) if isinstance(self.help, Mapping) else self.help

    def value_from(self, args: argparse.Namespace):
        return self.from_cli(args) if self.from_cli is not None else getattr(args, self.dest)


def option(default=None, *, factory: Callable[[], Any] | None = None, **spec) -> Any:
    """A dataclass field declared with its :class:`Option` (see there for ``spec``)."""
    meta = {"option": Option(**spec)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def described(cls) -> Iterator[tuple[dataclasses.Field, Option]]:
    """The fields of an options class with their Option, in declaration order."""
    for f in dataclasses.fields(cls):
        if "option" in f.metadata:
            yield f, f.metadata["option"]


def keyword_of(f: dataclasses.Field, opt: Option) -> str | None:
    return f.name if opt.keyword == "=" else opt.keyword


# --------------------------------------------------------------------------------------------
# Parsers of config values (the command line's grammar, so one grammar holds)


def _input_shapes(value, key):
    parsed = shapes.normalize(value)
    return [f"{name}={shapes.format_dims(dims)}" for name, dims in parsed.items()]


def _genai_folder(value, key):
    genai.check_folder(value)  # (one line: not a folder, no config.json, no tokenizer)
    return str(value)


def _layout(value, key):
    layouts.parse_layouts(value, key)  # (one line on a bad one; optimize takes the file's forms)
    return value


def _preprocess(value, key):
    layouts.parse_preprocess(value, key)
    return dict(value)


def _providers(value, key):
    return ",".join(verifier.parse_providers(value))


def _int_ranges(value, key):
    items = []
    for name, given in ((str(n), v) for n, v in value.items()):
        if isinstance(given, list) and len(given) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                               for v in given):
            given = f"{given[0]}:{given[1]}"
        if not isinstance(given, str):
            raise UsageError(f"{key}.{name}: expected \"LOW:HIGH\" or [LOW, HIGH], got {shown(given)}")
        items.append(f"{name}={given}")
    verifier.parse_int_ranges(items)
    return items


def shown(value) -> str:
    """A value as a message names it: its kind and (shortened) text."""
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a table"}.get(type(value), type(value).__name__)
    text = repr(value)
    return f"{kind} ({text if len(text) <= 40 else text[:37] + '...'})"


def _provider_options(value, key):
    parsed = verifier.parse_provider_options(value)
    return [f"{prov}:{name}={text}" for prov, options in parsed.items() for name, text in options.items()]


def _fidelity(value, key):
    return None if value is False else float(value)


def _quantize_methods() -> tuple:
    return QUANTIZE_METHODS


def _all_targets() -> tuple:
    return (*targets.TARGETS, *targets.ALIASES)


def _check_padding(value) -> None:
    if value not in PADDING:
        raise UsageError(f"padding {value!r}: choose any, right or none")


def _check_precision(value) -> None:
    if value not in ("fp32", "fp16"):
        raise UsageError(f"precision {value!r}: choose fp32 or fp16")


def _rules_files(args) -> list:
    from onnxopt.library import registry

    return [rule for path in args.rules for rule in registry.load_rules_file(path)]


def _provider_options_flag(args):
    return verifier.parse_provider_options(args.provider_option) if args.provider_option else None


_RULES, _LAYOUT, _INPUTS, _MEASURE = "rules", "layout", "inputs and tolerances", "measurement"
_REWRITERS = (OPTIMIZE, BISECT)
_RUNNERS = (OPTIMIZE, VERIFY, BISECT)
_MEASURERS = (OPTIMIZE, VERIFY)


# --------------------------------------------------------------------------------------------
# optimize()'s concerns


@dataclasses.dataclass(frozen=True)
class TargetOptions:
    """Where the model will run and in which precision."""

    target: str | None = option(
        None, flags=("--target",), commands=_REWRITERS, group=_RULES,
        argparse={"choices": [*targets.TARGETS, *targets.ALIASES], "metavar": "TARGET"},
        help="where the model will run: portable (default: standard ONNX ops only), ort-cpu, ort-cuda "
             "(onnxruntime's CPU or CUDA provider; cpu and cuda are aliases); only rules valid there run",
        key="target", about="where the model will run: portable, ort-cpu, ort-cuda (cpu and cuda are aliases); "
        "onnxopt quantize: ort-cpu or portable", choices=_all_targets)
    precision: str = option(
        "fp32", flags=("--precision",), argparse={"choices": ("fp32", "fp16"), "default": "fp32"},
        help="fp16: after the rules, float32 weights and compute become float16 (precision-sensitive ops stay "
             "float32, input and output types are kept); default fp32",
        key="precision", about="fp32 or fp16 (float16 weights and compute after the rules)",
        choices=lambda: ("fp32", "fp16"), validate=_check_precision)


@dataclasses.dataclass(frozen=True)
class RewriteOptions:
    """The rules, the passes and their limits."""

    exact: bool = option(
        False, flags=("--exact",), commands=_REWRITERS, group=_RULES,
        argparse={"action": argparse.BooleanOptionalAction, "default": False},
        help="only rewrites that keep every output bit-identical on onnxruntime's CPU provider with its default "
             "settings (rules declared exact; see --list-rules); --no-exact overrides a config file's exact",
        key="exact", kind="boolean", about="only rewrites that keep every output bit-identical on onnxruntime's CPU")
    max_rewrites: int | None = option(
        None, flags=("--max-rewrites",), commands=_REWRITERS, group=_RULES, argparse={"type": int, "metavar": "N"},
        help="cap on the number of rewrites", key="max_rewrites", kind="integer",
        about="cap on the number of rewrites", minimum=0)
    fold_size_limit: int = option(
        evaluate.DEFAULT_SIZE_LIMIT, flags=("--fold-size-limit",), commands=_REWRITERS, group=_RULES,
        argparse={"type": int, "metavar": "BYTES", "default": evaluate.DEFAULT_SIZE_LIMIT},
        help="constant folding creates a larger tensor only in place of at least as many bytes of constants that "
             "become unused (default 1 MiB)",
        key="fold_size_limit", kind="integer", about="bytes: the largest tensor constant folding creates without "
        "freeing as many", minimum=0)
    strict: bool | None = option(
        None, flags=("--strict",), commands=_REWRITERS, group=_RULES,
        argparse={"action": argparse.BooleanOptionalAction, "default": None},
        help="a rule that raises (a bug in it) stops the run with an error instead of being skipped and reported "
             "(default: on when ONNXOPT_STRICT=1); --no-strict overrides a config file's strict",
        key="strict", kind="boolean", about="a rule that raises stops the run instead of being skipped")
    extra_rules: Sequence = option(
        (), flags=("--rules",), commands=_REWRITERS, group=_RULES,
        argparse={"metavar": "FILE", "action": "append", "default": []},
        help="a Python file whose RULES are added to the built-in ones (repeatable)", from_cli=_rules_files,
        key="rules", kind="strings", about="Python files whose RULES are added to the built-in ones (paths)",
        path=True)
    disable: Iterable[str] = option(
        (), flags=("--disable",), commands=_REWRITERS, group=_RULES,
        argparse={"metavar": "RULE", "action": "append", "default": []}, help="leave a rule out (repeatable)",
        key="disable", kind="strings", about="rules (or passes) to leave out")
    rules: Sequence | None = option(
        None, flags=("--no-builtin-rules",), commands=_REWRITERS, group=_RULES, argparse={"action": "store_true"},
        help="use only the rules given with --rules",
        also=((("--builtin-rules",), {"dest": "no_builtin_rules", "action": "store_false",
                                      "default": argparse.SUPPRESS,
                                      "help": "the built-in rules too (the default; overrides a config file's "
                                              "no_builtin_rules)"}),),
        from_cli=lambda args: [] if args.no_builtin_rules else None,
        key="no_builtin_rules", kind="boolean", about="use only the rules of `rules`")
    graph_passes: Iterable[str] | None = option(None)
    fold_input_limit: int = option(evaluate.DEFAULT_INPUT_LIMIT)
    stop_after: int | None = option(None)


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """How the input is read and the result written."""

    external_data: str | bool | None = option(
        None, flags=("--external-data",), argparse={"metavar": "NAME", "nargs": "?", "const": True},
        help="save weights to an external data file (default name: OUTPUT.data)",
        also=((("--single-file",), {"action": "store_true", "help": "save weights inside the model file"}),),
        exclusive=True, from_cli=lambda args: False if args.single_file else args.external_data,
        key="external_data", kind="boolean|string", about="true: weights in OUTPUT.data; a file name: weights "
        "there; false: one file (--single-file)")
    genai: str | None = option(
        None, flags=("--genai",), argparse={"metavar": "HF_FOLDER"},
        help="also write onnxruntime-genai's genai_config.json and the tokenizer of this Hugging Face folder "
             "(the one the decoder was exported from) beside OUTPUT: OUTPUT's folder runs in onnxruntime-genai",
        key="genai", kind="string", about="the Hugging Face folder a decoder was exported from: "
        "genai_config.json and its tokenizer written beside the output (path)", path=True, check=_genai_folder)
    check: bool = option(True)
    inplace: bool = option(False)
    outputs: Any = option(None)  # an onnxopt.ir.io.Outputs


@dataclasses.dataclass(frozen=True)
class LayoutOptions:
    """The model's edges: input shapes fixed, channels-last inputs and outputs, raw-pixel inputs."""

    input_shapes: Any = option(
        None, flags=("--input-shape",), commands=_RUNNERS, group=_INPUTS,
        argparse={"metavar": "NAME=DIMS", "action": "append", "default": []},
        help="an input's shape, NAME=D1,D2,... or NAME=1x3x224x224 (repeatable): optimize fixes the model's input "
             "to it (a D may be a symbol name, which keeps or renames that dimension's symbol) and --verify runs "
             "at it; verify and bisect generate the input at it (numbers only)",
        from_cli=lambda args: shapes.parse(args.input_shape),
        key="input_shapes", kind="table", about="input name = \"1x3x224x224\", \"batch,3,224,224\" or "
        "[1, 3, 224, 224] (symbols keep or rename a dimension)", check=_input_shapes)
    input_layout: Any = option(
        None, flags=("--input-layout",), group=_LAYOUT,
        argparse={"metavar": "NAME=LAYOUT", "action": "append", "default": []},
        help="an input the model is to take channels-last, e.g. x=NHWC (or NHWC: every 4-D input); a Transpose at "
             "the input gives the model its NCHW (repeatable)",
        key="layout.input", kind="string|table", about="input name = \"NHWC\" (channels-last input), or \"NHWC\" "
        "for every 4-D input", check=_layout)
    output_layout: Any = option(
        None, flags=("--output-layout",), group=_LAYOUT,
        argparse={"metavar": "NAME=LAYOUT", "action": "append", "default": []},
        help="an output the model is to return channels-last, e.g. y=NHWC (repeatable)",
        key="layout.output", kind="string|table", about="output name = \"NHWC\" (channels-last output)",
        check=_layout)
    padding: str = option(
        "any", flags=("--padding",), group=_INPUTS, argparse={"choices": PADDING, "default": "any"},
        help="where a decoder's attention_mask holds zeros: any (default: GroupQueryAttention reads the model's "
             "own mask, exact for every mask; ort-cpu only), right (each row's zeros at its end, as onnxruntime-genai "
             "feeds its models) or none (every entry 1): GroupQueryAttention reads the sequence lengths from the "
             "mask instead (needed on ort-cuda, whose kernel takes no mask), after checking that the model's mask "
             "is causal with that padding (and a sliding window)",
        key="padding", about="a decoder's attention_mask: any (default), right (zeros at the end of each row) or none "
        "(all ones): lengths read from the mask (GroupQueryAttention on ort-cuda)", choices=lambda: PADDING,
        validate=_check_padding)
    input_preprocess: Any = option(
        None, flags=("--input-preprocess",), group=_LAYOUT,
        argparse={"metavar": "NAME=SPEC", "action": "append", "default": []},
        help="an input that becomes raw images, e.g. x=uint8,HWC,scale=1/255,mean=0.485,0.456,0.406,"
             "std=0.229,0.224,0.225[,bgr]: the model casts, swaps channels and normalizes itself (folded into the "
             "first Conv where it can be) (repeatable)",
        key="layout.preprocess", kind="table", about="input name = \"uint8,HWC,scale=1/255,mean=...,std=...\" or a "
        "table {layout = \"HWC\", scale = ..., mean = [...], std = [...], bgr = true}", check=_preprocess)

    def edges(self):
        """The edges asked for (``onnxopt.transforms.edges.spec``): one line on a bad spec."""
        return layouts.spec(self.input_layout, self.output_layout, self.input_preprocess)


@dataclasses.dataclass(frozen=True)
class VerifyOptions:
    """Verification before writing: the providers and the verifier's settings. The fields below
    ``providers`` are ``onnxopt.verify.verify``'s keywords (None: its default); ``settings`` (the
    ``verify_options=`` keyword) takes any of them and the rest (feeds, progress, ...), and wins."""

    providers: bool | str | Sequence[str] = option(
        False, flags=("--verify",), argparse={"metavar": "PROVIDERS"},
        help="before writing, verify the result against the input on onnxruntime (cpu, cuda or cpu,cuda): on a "
             "difference, exit 1 and write nothing",
        from_cli=lambda args: False if args.verify is None else args.verify,
        key="verify.providers", kind="string|strings", about="verify before writing on these providers: \"cpu\", "
        "\"cuda\", \"cpu,cuda\" or a list", check=_providers, keyword="verify")
    rtol: float | None = option(
        None, flags=("--rtol",), commands=_RUNNERS, group=_INPUTS, argparse={"type": float},
        help="relative tolerance for every output (default per dtype: float32 1e-4, float16 1e-2, ...)",
        key="verify.rtol", kind="number", about="relative tolerance for every output", minimum=0, keyword=None)
    atol: float | None = option(
        None, flags=("--atol",), commands=_RUNNERS, group=_INPUTS, argparse={"type": float},
        help="absolute tolerance for every output (default per dtype: float32 1e-5, float16 1e-3, ...)",
        key="verify.atol", kind="number", about="absolute tolerance for every output", minimum=0, keyword=None)
    runs: int | None = option(
        None, flags=("--runs",), commands=_MEASURERS, group=_MEASURE,
        argparse={"type": int, "default": verifier.LATENCY_RUNS, "metavar": "N"},
        help="at most N interleaved timing rounds (each runs both models) per provider after the warm-up (default "
             f"{verifier.LATENCY_RUNS}; 0: no latency)",
        key="verify.runs", kind="integer", about="the most interleaved timing rounds per provider (0: no latency)",
        minimum=0, keyword=None)
    latency_budget: float | None = option(
        None, flags=("--latency-budget",), commands=_MEASURERS, group=_MEASURE,
        argparse={"type": float, "default": verifier.LATENCY_BUDGET_S, "metavar": "SECONDS"},
        help=f"at most this many seconds of timing rounds per provider (default {verifier.LATENCY_BUDGET_S:g}); the "
             "ratio's 90%% interval narrows with more rounds",
        key="verify.latency_budget", kind="number", about="seconds of timing rounds per provider at most",
        minimum=0, keyword=None)
    warmup: int | None = option(
        None, flags=("--warmup",), commands=_MEASURERS, group=_MEASURE,
        argparse={"type": int, "default": 5, "metavar": "N"}, help="warm-up runs per session (default 5)",
        key="verify.warmup", kind="integer", about="warm-up runs per session", minimum=1, keyword=None)
    threads: int | None = option(
        None, flags=("--threads",), commands=_MEASURERS, group=_MEASURE,
        argparse={"type": int, "default": verifier.LATENCY_THREADS, "metavar": "N"},
        help=f"onnxruntime intra-op threads of the sessions (default {verifier.LATENCY_THREADS}: timings that "
             "repeat; 0: onnxruntime's choice)",
        key="verify.threads", kind="integer", about="onnxruntime intra-op threads (default 1; 0: onnxruntime's)",
        minimum=0, keyword=None)
    seed: int | None = option(
        None, flags=("--seed",), commands=_RUNNERS, group=_INPUTS, argparse={"type": int, "default": 0},
        help="seed of the generated inputs (default 0)",
        key="verify.seed", kind="integer", about="seed of the generated inputs", minimum=0, keyword=None)
    inputs: str | os.PathLike | None = option(
        None, flags=("--inputs",), commands=_RUNNERS, group=_INPUTS, argparse={"metavar": "FILE.npz"},
        help="input arrays by name (others are generated)",
        key="verify.inputs", about="an .npz of input arrays by name (path)", path=True, keyword=None)
    int_ranges: Mapping | None = option(
        None, flags=("--int-range",), commands=_RUNNERS, group=_INPUTS,
        argparse={"metavar": "NAME=LOW:HIGH", "action": "append", "default": []},
        help="inclusive range of a generated integer input, e.g. input_ids=0:30521 (repeatable; default: the rows "
             "of the Gather table it indexes, 0:1 for names with 'mask', else 0:9)",
        from_cli=lambda args: verifier.parse_int_ranges(args.int_range),
        key="verify.int_ranges", kind="table", about="integer input name = \"LOW:HIGH\" or [LOW, HIGH] (inclusive)",
        check=_int_ranges, keyword=None)
    provider_options: Mapping | None = option(
        None, flags=("--provider-option",), commands=_MEASURERS, group=_MEASURE,
        argparse={"action": "append", "default": [], "metavar": "PROVIDER:NAME=VALUE"},
        help="an execution provider option for both models' sessions, e.g. cuda:prefer_nhwc=1 or "
             "cuda:enable_cuda_graph=1 (repeatable; the advice of --target ort-cuda names them)",
        from_cli=_provider_options_flag,
        key="verify.provider_options", kind="table", about="provider = {option = value}, e.g. "
        "cuda = {prefer_nhwc = 1}", check=_provider_options, keyword=None)
    decode: int | None = option(
        None, flags=("--decode",), commands=_MEASURERS, group=_INPUTS, argparse={"type": int, "metavar": "N"},
        help="decoders with a key/value cache (past_key_values.N.key/value in, present.N.key/value out): also "
             "generate N tokens greedily on each prompt with both models, each with its own cache, and compare token "
             "by token and the logits of every step (float32: every token identical; float16: at least 99%%)",
        key="verify.decode", kind="integer", about="tokens of greedy generation to compare (decoders; 0: none)",
        minimum=0, keyword=None)
    decode_prompts: str | os.PathLike | None = option(
        None, flags=("--decode-prompts",), commands=_MEASURERS, group=_INPUTS, argparse={"metavar": "FILE.json"},
        help="the prompts of --decode: a JSON list of token id lists (default: 8 generated prompts of 8 tokens)",
        key="verify.decode_prompts", about="a JSON list of token id lists for --decode (path)", path=True,
        keyword=None)
    settings: Mapping | None = option(None, keyword="verify_options")

    _VERIFIER_NAMES: ClassVar[Mapping[str, str]] = {"latency_budget": "budget_s"}

    def verifier_kwargs(self) -> dict | None:
        """``onnxopt.verify.verify``'s keyword arguments (None where none is set): the fields
        given, then ``settings``."""
        given = {self._VERIFIER_NAMES.get(f.name, f.name): getattr(self, f.name)
                 for f, _ in described(type(self)) if f.name not in ("providers", "settings")
                 and getattr(self, f.name) is not None}
        if not given and self.settings is None:
            return None
        return {**given, **(self.settings or {})}


@dataclasses.dataclass(frozen=True)
class ReportOptions:
    """What is reported and where. ``json``, ``quiet`` and ``html`` are the command line's (the
    JSON report, silence, the HTML page): no ``optimize()`` keyword of their own."""

    json: str | None = option(
        None, flags=("--json",), commands=(*_RUNNERS, QUANTIZE), argparse={"metavar": "REPORT"},
        help="also write the report as JSON to this file",
        key="report.json", about="also write the report as JSON here (path)", path=True, keyword=None)
    quiet: bool = option(
        False, flags=("-q", "--quiet"), commands=(*_RUNNERS, QUANTIZE), argparse={"action": "store_true"},
        help={OPTIMIZE: "print nothing on success; no progress on stderr",
              QUANTIZE: "print nothing on success; no progress on stderr",
              VERIFY: "print only the verdict line; no progress on stderr",
              BISECT: "print only the culprit line; no progress on stderr"},
        also=((("--no-quiet",), {"dest": "quiet", "action": "store_false", "default": argparse.SUPPRESS,
                                 "help": "print as usual (overrides a config file's report.quiet)"}),),
        key="report.quiet", kind="boolean", about="print nothing on success; no progress", keyword=None)
    diff: str | os.PathLike | None = option(
        None, flags=("--diff",), argparse={"metavar": "PAGE.html"},
        help="also write the static diff page (what each rule did, node by node; the live view: onnxopt diff MODEL "
             "OUTPUT)",
        key="report.diff", about="also write the static diff page here (path)", path=True)
    html: str | None = option(
        None, flags=("--report",), argparse={"metavar": "PAGE.html"},
        help="also write the report as one self-contained HTML page: the tables, where FLOPs, bytes and (with "
             "--verify) measured latency go by op type, memory over time, the verification, a link to --diff's page",
        key="report.html", about="also write the HTML report page here (path)", path=True, keyword=None)
    return_report: bool = option(False)
    progress: Callable | None = option(None)


_CONCERNS = {"target": TargetOptions, "rewrite": RewriteOptions, "save": SaveOptions, "layout": LayoutOptions,
             "verify": VerifyOptions, "report": ReportOptions}


def _concern(name: str):
    """A concern's field of OptimizeOptions: its default made by the class registered for it."""
    return dataclasses.field(default_factory=lambda: _CONCERNS[name]())


@dataclasses.dataclass(frozen=True)
class OptimizeOptions:
    """Everything ``optimize()`` takes besides the model and the output path, by concern. Build it
    with the concerns (``OptimizeOptions(target=TargetOptions(target="ort-cuda"))``) or from the
    old keywords (``OptimizeOptions().with_shortcuts(target="ort-cuda")``)."""

    target: TargetOptions = _concern("target")
    rewrite: RewriteOptions = _concern("rewrite")
    save: SaveOptions = _concern("save")
    layout: LayoutOptions = _concern("layout")
    verify: VerifyOptions = _concern("verify")
    report: ReportOptions = _concern("report")
    # INT8 quantization after the cleanup: a dict of onnxopt.quantize's options (see optimize())
    quantize: Mapping | None = option(None)

    CONCERNS: ClassVar[Mapping[str, type]] = _CONCERNS

    @classmethod
    def keywords(cls) -> dict[str, tuple[str | None, str]]:
        """``optimize()``'s keywords: keyword -> (concern, field); concern None for this class's own."""
        found: dict[str, tuple[str | None, str]] = {}
        for concern, klass in cls.CONCERNS.items():
            for f, opt in described(klass):
                if keyword_of(f, opt) is not None:
                    found[keyword_of(f, opt)] = (concern, f.name)
        for f, opt in described(cls):
            if keyword_of(f, opt) is not None:
                found[keyword_of(f, opt)] = (None, f.name)
        return found

    def with_shortcuts(self, _face: str = "optimize", **shortcuts) -> OptimizeOptions:
        """These options with ``optimize()``'s keywords applied (each sets its field); an unknown
        keyword is a TypeError, as a Python call's."""
        known = self.keywords()
        changes: dict[str | None, dict] = {}
        for name, value in shortcuts.items():
            if name not in known:
                raise TypeError(f"{_face}() got an unexpected keyword argument {name!r}")
            concern, field = known[name]
            changes.setdefault(concern, {})[field] = value
        if not changes:
            return self
        own = changes.pop(None, {})
        return dataclasses.replace(self, **own, **{c: dataclasses.replace(getattr(self, c), **kw)
                                                   for c, kw in changes.items()})

    def validate(self) -> None:
        """Each field's own check (``Option.validate``), in declaration order: a one-line UsageError."""
        for concern in (*self.CONCERNS, None):
            part = self if concern is None else getattr(self, concern)
            for f, opt in described(type(part)):
                if opt.validate is not None:
                    opt.validate(getattr(part, f.name))

    def shortcuts(self) -> dict:
        """The options as ``optimize()``'s keywords (``verify_options``: the verifier's keywords)."""
        out = {}
        for name, (concern, field) in self.keywords().items():
            out[name] = getattr(self if concern is None else getattr(self, concern), field)
        out["verify_options"] = self.verify.verifier_kwargs()
        return out

    @classmethod
    def from_args(cls, args: argparse.Namespace, command: str = OPTIMIZE, without: Iterable[str] = (),
                  **given) -> OptimizeOptions:
        """The options a parsed command line sets: each field whose flag ``command`` takes, from
        its flag (``Option.from_cli``), but for the concerns ``without`` (left at their defaults);
        ``given``: keyword values computed by the caller instead."""
        parts = {}
        for concern, klass in cls.CONCERNS.items():
            if concern in without:
                continue
            values = {f.name: opt.value_from(args) for f, opt in described(klass)
                      if opt.flags and command in opt.commands and keyword_of(f, opt) not in given}
            parts[concern] = klass(**values)
        return cls(**parts).with_shortcuts(**given)


# --------------------------------------------------------------------------------------------
# quantize()'s


@dataclasses.dataclass(frozen=True)
class QuantizeOptions:
    """Everything ``quantize()`` takes besides the model, the calibration data and the output path.
    ``calibration`` and ``percentile`` are the command line's (``--calib``, ``--percentile``):
    ``quantize()`` takes them as its second argument and in ``method_options``."""

    calibration: str | None = option(
        None, flags=("--calib",), commands=(QUANTIZE,), argparse={"metavar": "DATA"},
        help="calibration data (see below; required, here or as calibration in the config file's [quantize])",
        key="quantize.calibration", about="calibration data: a folder of .npy/.npz, or one .npz (path)", path=True,
        keyword=None)
    method: str = option(
        DEFAULT_METHOD, flags=("--method",), commands=(QUANTIZE,),
        argparse={"choices": _quantize_methods, "default": DEFAULT_METHOD},  # (choices: called)
        help=f"calibration method (default {DEFAULT_METHOD})",
        key="quantize.method", about="calibration method", choices=_quantize_methods)
    per_channel: bool = option(
        True, flags=("--per-channel",), commands=(QUANTIZE,),
        argparse={"dest": "per_channel", "action": "store_true", "default": True},
        help="weights per output channel where the op allows (default)",
        also=((("--per-tensor",), {"dest": "per_channel", "action": "store_false", "help": "weights per tensor"}),),
        exclusive=True, key="quantize.per_channel", kind="boolean",
        about="weights per output channel (false: --per-tensor)")
    exclude: Iterable[str] = option(
        (), flags=("--exclude",), commands=(QUANTIZE,),
        argparse={"metavar": "NAME_OR_OP", "nargs": "+", "action": "extend", "default": []},
        help="node names or op types to leave in float",
        key="quantize.exclude", kind="strings", about="node names or op types left in float")
    fidelity: float | None = option(
        DEFAULT_FIDELITY_DB, flags=("--fidelity",), commands=(QUANTIZE,),
        argparse={"type": float, "default": DEFAULT_FIDELITY_DB, "metavar": "DB"},
        help=f"minimum output SQNR (dB) against the float model on held-out calibration samples (default "
             f"{DEFAULT_FIDELITY_DB:g}); the layers that hurt most fall back to float until met",
        also=((("--no-fidelity",), {"dest": "fidelity", "action": "store_const", "const": None,
                                    "help": "no fidelity target (no fallback)"}),),
        key="quantize.fidelity", kind="number|false", about="minimum output SQNR (dB) on held-out samples; false: "
        "none (--no-fidelity)", check=_fidelity)
    keep_float: str = option(
        "auto", flags=("--keep-float",), commands=(QUANTIZE,),
        argparse={"choices": ["auto", "measure", "never"], "default": "auto"},
        help="auto (default): keep the float model unless the shipped cost table estimates int8 at least 3%% "
             "faster (no timing: the same bytes run to run); measure: time both models on this machine instead "
             "(machine-dependent; --threads); never: always int8",
        key="quantize.keep_float", about="auto: keep the float model unless the shipped cost table estimates int8 "
        "3% faster; measure: time both on this machine (machine-dependent); never: always int8",
        choices=lambda: ("auto", "measure", "never"))
    threads: int = option(
        1, flags=("--threads",), commands=(QUANTIZE,), argparse={"type": int, "default": 1, "metavar": "N"},
        help="onnxruntime intra-op threads of --keep-float measure's timing (default 1; 0: onnxruntime's)",
        key="quantize.threads", kind="integer", about="onnxruntime intra-op threads of --keep-float measure "
        "(default 1)", minimum=0)
    latency_budget: float = option(
        10.0, flags=("--latency-budget",), commands=(QUANTIZE,),
        argparse={"type": float, "default": 10.0, "metavar": "SECONDS"},
        help="seconds of --keep-float measure's timing rounds at most (default 10)",
        key="quantize.latency_budget", kind="number", about="seconds of --keep-float measure's timing at most",
        minimum=0)
    reduce_range: bool | None = option(
        None, flags=("--reduce-range",), commands=(QUANTIZE,), argparse={"action": "store_true", "default": None},
        help="7-bit weights, for x86 CPUs without VNNI (default off)",
        key="quantize.reduce_range", kind="boolean", about="7-bit weights (x86 CPUs without VNNI)")
    workers: int = option(
        1, flags=("--workers",), commands=(QUANTIZE,), argparse={"type": int, "default": 1, "metavar": "N"},
        help="calibration processes (results bit-identical for any N)",
        key="quantize.workers", kind="integer", about="calibration processes", minimum=1)
    held_out: int | None = option(
        None, flags=("--held-out",), commands=(QUANTIZE,), argparse={"type": int, "default": None, "metavar": "N"},
        help="calibration samples kept to measure fidelity (default a quarter, at least 8 where half remain, at "
             "most 64)",
        key="quantize.held_out", kind="integer", about="calibration samples kept to measure fidelity", minimum=0)
    percentile: float | None = option(
        None, flags=("--percentile",), commands=(QUANTIZE,), argparse={"type": float, "default": None, "metavar": "P"},
        help="--method percentile: the percentile kept (default 99.999)",
        key="quantize.percentile", kind="number", about="method percentile: the percentile kept", minimum=0,
        keyword=None)
    input_shapes: Any = option(
        None, flags=("--input-shape",), commands=(QUANTIZE,),
        argparse={"metavar": "NAME=DIMS", "action": "append", "default": []},
        help="fix an input's shape first (as onnxopt MODEL --input-shape)",
        from_cli=lambda args: shapes.parse(args.input_shape), key="input_shapes", check=_input_shapes)
    target: str | None = option(
        None, flags=("--target",), commands=(QUANTIZE,), argparse={"default": "ort-cpu", "metavar": "TARGET"},
        help="ort-cpu (default) or portable; ort-cuda is refused (its QDQ kernels run in float)", key="target")
    strict: bool | None = option(
        None, flags=("--strict",), commands=(QUANTIZE,), argparse={"action": "store_true", "default": None},
        help="a rule bug stops the run", key="strict")
    method_options: Mapping | None = option(
        None, from_cli=lambda args: {} if args.percentile is None else {"percentile": args.percentile})
    external_data: str | bool | None = option(None)
    check: bool = option(True)
    return_report: bool = option(False)
    outputs: Any = option(None)
    progress: Callable | None = option(None)

    @classmethod
    def keywords(cls) -> dict[str, str]:
        """``quantize()``'s keywords: keyword -> field."""
        return {keyword_of(f, opt): f.name for f, opt in described(cls) if keyword_of(f, opt) is not None}

    def with_shortcuts(self, **shortcuts) -> QuantizeOptions:
        known = self.keywords()
        for name in shortcuts:
            if name not in known:
                raise TypeError(f"quantize() got an unexpected keyword argument {name!r}")
        return dataclasses.replace(self, **{known[k]: v for k, v in shortcuts.items()}) if shortcuts else self

    def shortcuts(self) -> dict:
        return {name: getattr(self, field) for name, field in self.keywords().items()}

    @classmethod
    def from_args(cls, args: argparse.Namespace, **given) -> QuantizeOptions:
        values = {f.name: opt.value_from(args) for f, opt in described(cls)
                  if (opt.flags and QUANTIZE in opt.commands or opt.from_cli is not None) and f.name not in given}
        return cls(**values).with_shortcuts(**given)


# --------------------------------------------------------------------------------------------
# What the faces derive


ALL_CLASSES: tuple[type, ...] = (*_CONCERNS.values(), OptimizeOptions, QuantizeOptions)


def declared() -> list[tuple[dataclasses.Field, Option]]:
    """Every described field of every options class, in declaration order."""
    return sorted(((f, opt) for cls in ALL_CLASSES for f, opt in described(cls)), key=lambda fo: fo[1].order)


def flag_options(command: str) -> list[tuple[str, Option]]:
    """The options whose flags ``command``'s parser takes: (field name, Option), declaration order."""
    return [(f.name, opt) for f, opt in declared() if opt.flags and command in opt.commands]


def config_options() -> list[tuple[str, list[Option]]]:
    """The config keys in declaration order, each with the options (one per command) it sets."""
    keys: dict[str, list[Option]] = {}
    for _, opt in declared():
        if opt.key is not None:
            keys.setdefault(opt.key, []).append(opt)
    return list(keys.items())


__all__ = ["DEFAULT_FIDELITY_DB", "DEFAULT_METHOD", "QUANTIZE_METHODS", "LayoutOptions", "OptimizeOptions", "Option", "QuantizeOptions",
           "ReportOptions", "RewriteOptions", "SaveOptions", "TargetOptions", "VerifyOptions", "config_options",
           "declared", "flag_options", "option"]
