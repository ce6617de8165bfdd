"""Command-line flags derived from the config dataclasses: every field declared with `flag(...)`
(or with "help" in its metadata) is `--name-with-dashes`, typed from its annotation, with its
default, choices and help. Adding a config field adds its flag; there is no second list.

    int | None -> type=int, default None      bool -> --x / --no-x
    metadata "type" overrides the parser type (the R3 config is given as JSON text)
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterator
from typing import Any

from fastdeploy_r3.config.engine import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from fastdeploy_r3.config.speculative import SpeculativeConfig
from fastdeploy_r3.errors import ConfigError

# the dataclasses whose fields are engine flags, in --help order
SECTIONS: tuple[type, ...] = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, EngineConfig)


def cli_fields() -> Iterator[tuple[dataclasses.Field, Any]]:
    """(field, resolved annotation) of every flag field."""
    for cls in SECTIONS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.init and "help" in f.metadata and f.metadata.get("cli", True):
                yield f, hints[f.name]


def _scalar_type(hint: Any) -> Any:
    """int | None -> int; a plain type stays itself."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"a flag field must have one type (optionally | None), not {hint}")
        return args[0]
    return hint


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for f, hint in cli_fields():
        name = "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = {"help": f.metadata["help"], "dest": f.name}
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kw["required"] = True
        else:
            kw["default"] = None if f.default is dataclasses.MISSING else f.default
        typ = f.metadata.get("type") or _scalar_type(hint)
        if typ is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = typ
            if f.metadata.get("choices"):
                kw["choices"] = f.metadata["choices"]
        if "default" in kw and kw["default"] is not None:
            kw["help"] += " (default: %(default)s)"
        parser.add_argument(name, **kw)
    sg = parser.add_argument_group("SGLang's speculative flags (the same as --speculative-config)")
    sg.add_argument("--speculative-algorithm", default=None,
                    help="NGRAM: n-gram prompt-lookup drafts; EAGLE or NEXTN: GLM-4.5's draft (MTP) layer")
    sg.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                    help="tokens per verify, the verified one the drafts follow included (drafts = this - 1)")
    sg.add_argument("--speculative-ngram-min-match-window-size", type=int, default=None,
                    help="shortest n-gram looked up (prompt_lookup_min)")
    sg.add_argument("--speculative-ngram-max-match-window-size", type=int, default=None,
                    help="longest n-gram looked up (prompt_lookup_max)")
    sg.add_argument("--speculative-num-steps", type=int, default=None,
                    help="EAGLE / NEXTN: draft steps (= drafts per verify: chains of one token per step)")
    sg.add_argument("--speculative-eagle-topk", type=int, default=None,
                    help="EAGLE / NEXTN: branches per draft step; only 1 (a chain) is served")
    return parser


def _sglang_speculative(args: argparse.Namespace) -> SpeculativeConfig | None:
    algorithm = getattr(args, "speculative_algorithm", None)
    rest = [getattr(args, n, None) for n in ("speculative_num_draft_tokens", "speculative_ngram_min_match_window_size",
                                             "speculative_ngram_max_match_window_size", "speculative_num_steps",
                                             "speculative_eagle_topk")]
    if algorithm is None:
        if any(v is not None for v in rest):
            raise ConfigError("the --speculative-num-draft-tokens / --speculative-ngram-* / --speculative-num-steps "
                              "flags need --speculative-algorithm (NGRAM, EAGLE or NEXTN)")
        return None
    if getattr(args, "speculative_config", None):
        raise ConfigError("give either --speculative-config or --speculative-algorithm, not both")
    return SpeculativeConfig.from_sglang(algorithm, *rest)


def engine_config_from_args(args: argparse.Namespace, **extra: Any) -> EngineConfig:
    """The engine's config from its flags; `extra`: fields no flag sets (the API server's, e.g. pd_receiver)."""
    kwargs = {f.name: getattr(args, f.name) for f, _ in cli_fields() if f.name != "model"} | extra
    sglang = _sglang_speculative(args)
    if sglang is not None:
        kwargs["speculative_config"] = sglang
    return EngineConfig.from_kwargs(args.model, **kwargs)
