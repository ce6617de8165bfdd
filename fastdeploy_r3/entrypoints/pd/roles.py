"""What a server of each disaggregation mode does with a request that carries bootstrap fields.

    null      serves it whole (the fields are accepted and ignored, as SGLang's non-PD server does)
    prefill   computes the prompt and samples the first token (max_tokens 1; its answer, R3 of the
              prompt included, is the router's to discard: it returns D's), waits until the prompt's
              blocks (the partial last one too, stored as the request ends: keep_prompt_tail), KV and R3
              rows together, are stored in the shared KV store (--kv-storage), then publishes the room's
              handoff
    decode    fetches the handoff from P's bootstrap server (before the request enters the engine, so
              nothing is reserved while P works), checks prompt and weight version, and runs the prompt
              plus P's first token: the prompt's blocks, the partial last one too (peer_prompt_tokens),
              are storage hits (their rows are P's, as of any stored block), the first token is computed
              here, and put back in front of the output (with P's logprob and text)

With --disaggregation-transfer-backend mooncake each server has its own store: P also names the blocks
it stored in an outbox (read again from its store when D asks for them). D hands the room to its engine
with the request: as the engine admits it, its cache transfer manager has P write the blocks over
Mooncake Transfer Engine into the blocks it reserved (te_in_place.py, cache_manager/pd_receive.py; on
CUDA through a host landing buffer and one copy).

R3 across the boundary: D's engine holds prompt + first token as its prompt, so its rows are
[0, P + 1) for that prompt plus one per further token: P + 1 + (N - 1) - 1 = P + N - 1 rows, the
rows of a colocated run, each gathered under its block's tag as always.

A first token that ends the request (a stop token, or max_tokens 1) still runs on D with max_tokens 1,
so that D has the prompt's rows; D's own sample is replaced by P's token, text and finish reason.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from collections.abc import AsyncIterator

from fastdeploy_r3.config import EngineConfig
from fastdeploy_r3.engine.messages import AwaitWriteThrough
from fastdeploy_r3.entrypoints.engine_client import AsyncEngineClient, EngineWeightVersionError
from fastdeploy_r3.entrypoints.pd.bootstrap import BootstrapServer, Rooms, fetch_handoff
from fastdeploy_r3.entrypoints.pd.handoff import UPDATE_BOTH, Bootstrap, Handoff, HandoffError, prompt_digest
from fastdeploy_r3.entrypoints.pd.te_blocks import TeBlocks
from fastdeploy_r3.entrypoints.pd.te_transfer import DEFAULT_ARENA_MB, Outbox, TeArena, TeSender
from fastdeploy_r3.errors import ConfigError
from fastdeploy_r3.outputs import RequestDelta, TextRule, WeightVersionSpan
from fastdeploy_r3.sampling_params import InvalidRequestError, SamplingParams

MODES = ("null", "prefill", "decode")
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's
_CONTROL_TIMEOUT_S = 60.0


def add_pd_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("prefill/decode disaggregation (SGLang's flags; docs/pd.md)")
    g.add_argument("--disaggregation-mode", choices=MODES, default="null",
                   help="null: serve requests whole; prefill: compute prompts and hand them to a decode server; "
                        "decode: continue requests a prefill server handed over")
    g.add_argument("--disaggregation-bootstrap-port", type=int, default=DEFAULT_BOOTSTRAP_PORT,
                   help="prefill: the port of its bootstrap server, where decode servers fetch handoffs (the "
                        "port sglang-router's --prefill URL PORT names)")
    g.add_argument("--disaggregation-transfer-backend", choices=("store", "mooncake"), default="store",
                   help="how blocks travel from P to D: store = through the shared --kv-storage (Redis, "
                        "Mooncake Store or a shared directory) both servers are started with; mooncake = P "
                        "writes them into memory D reserved, over Mooncake Transfer Engine (each server keeps "
                        "its own --kv-storage)")
    g.add_argument("--disaggregation-te-arena-mb", type=int, default=DEFAULT_ARENA_MB,
                   help="mooncake backend, prefill servers: the memory registered with the transfer engine for "
                        "the blocks being written (a decode server's cache transfer manager registers what it "
                        "receives into)")


def pd_engine_fields(args: argparse.Namespace) -> dict[str, bool]:
    """Engine config fields the role sets (config/cli.py engine_config_from_args): a mooncake decode server's
    cache transfer manager readies its transfer engine as it starts (CacheTransferConfig.pd_receiver)."""
    decode = args.disaggregation_mode == "decode" and args.disaggregation_transfer_backend == "mooncake"
    return {"pd_receiver": True} if decode else {}


def check_pd_flags(args: argparse.Namespace, config: EngineConfig) -> None:
    """ConfigError naming the flag to change, before anything starts."""
    if args.disaggregation_mode == "null":
        return
    if config.cache_config.kv_storage is None or not config.cache_config.enable_prefix_caching:
        if args.disaggregation_transfer_backend == "mooncake":
            raise ConfigError(f"--disaggregation-mode {args.disaggregation_mode} with the mooncake backend keeps "
                              "the blocks that travel in each server's own store: give each a --kv-storage (e.g. "
                              "file:///var/cache/fdr3_p and file:///var/cache/fdr3_d) and prefix caching on")
        raise ConfigError(f"--disaggregation-mode {args.disaggregation_mode} moves blocks through the shared KV "
                          "store: start P and D with the same --kv-storage (e.g. redis://127.0.0.1:6379/0) and "
                          "prefix caching on")
    if args.disaggregation_transfer_backend == "mooncake" and args.disaggregation_te_arena_mb < 1:
        raise ConfigError(f"--disaggregation-te-arena-mb {args.disaggregation_te_arena_mb}; use at least 1")
    if not 1 <= args.disaggregation_bootstrap_port <= 65535:
        raise ConfigError(f"--disaggregation-bootstrap-port {args.disaggregation_bootstrap_port}; use a TCP port")


async def start_pd_role(args: argparse.Namespace, engine: AsyncEngineClient) -> PdPrefill | PdDecode | None:
    """The server's role (prefill: with its bootstrap server listening); None in mode null."""
    if args.disaggregation_mode == "null":
        return None
    te = None
    if args.disaggregation_transfer_backend == "mooncake":
        # D's CTM takes P's writes (cache_manager/pd_receive.py): only P needs an arena here, its writes' source
        decode = args.disaggregation_mode == "decode"
        te = TeBlocks(engine.config, None if decode else TeArena(args.disaggregation_te_arena_mb << 20))
    if args.disaggregation_mode == "prefill":
        rooms = Rooms()
        sender = None if te is None else TeSender(te.arena, Outbox())
        return PdPrefill(engine, rooms, BootstrapServer(rooms, args.host, args.disaggregation_bootstrap_port, sender),
                         te, sender)
    return PdDecode(engine, te)


class PdPrefill:
    mode = "prefill"

    def __init__(self, engine: AsyncEngineClient, rooms: Rooms, server: BootstrapServer,
                 te: TeBlocks | None = None, sender: TeSender | None = None) -> None:
        self.engine, self.rooms, self.server = engine, rooms, server
        self.te, self.sender = te, sender
        self.transfer_backend = "store" if te is None else "mooncake"

    @property
    def bootstrap_port(self) -> int:
        return self.server.port

    async def close(self) -> None:
        await self.server.close()
        if self.te is not None:
            self.te.close()

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None, boot: Bootstrap, deadline: float) -> AsyncIterator[RequestDelta]:
        _check_pd_params(params)
        first = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        digest = prompt_digest(prompt_token_ids)
        published = False

        def publish(**kw) -> None:
            nonlocal published
            published = True
            self.rooms.publish(Handoff(room=boot.room, num_prompt_tokens=len(prompt_token_ids),
                                       prompt_digest=digest, **kw))

        token_ids: list[int] = []
        text: list[str] = []
        logprobs: list = []
        try:
            async for delta in self.engine.generate(request_id, prompt_token_ids, first, prompt, keep_prompt_tail=True):
                c = delta.outputs[0]
                token_ids += c.token_ids
                text.append(c.text)
                logprobs += c.logprobs or []
                if delta.finished:
                    reply = await self.engine.control(AwaitWriteThrough(), timeout_s=_CONTROL_TIMEOUT_S)
                    version = reply.state.weight_version
                    if c.error is not None or not token_ids:
                        publish(weight_version=version, error=c.error or f"finished {c.finish_reason} without a token")
                    else:
                        if self.te is not None and self.sender is not None:  # before D can ask for them
                            self.sender.outbox.put(boot.room, *await self.te.read(prompt_token_ids, version))
                        publish(weight_version=version, token_id=token_ids[0], text="".join(text),
                                logprob=logprobs[0] if logprobs else None, finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason, num_cached_tokens=delta.num_cached_tokens)
                yield delta
        finally:
            if not published:  # aborted, timed out, the engine gone: D hears it now, not at its deadline
                publish(weight_version="", error="the prefill request ended before its first token")


class PdDecode:
    mode = "decode"
    bootstrap_port = None

    def __init__(self, engine: AsyncEngineClient, te: TeBlocks | None = None) -> None:
        self.engine, self.te = engine, te
        self.transfer_backend = "store" if te is None else "mooncake"
        self._releases: set[asyncio.Task] = set()  # rooms being handed back to P (te_blocks.release)

    async def close(self) -> None:
        if self.te is not None:
            self.te.close()

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None, boot: Bootstrap, deadline: float) -> AsyncIterator[RequestDelta]:
        _check_pd_params(params)
        handoff = await fetch_handoff(boot, deadline)
        # P's weight version is checked by the engine as the request arrives (no round trip before it, and
        # no update can slip in between); blocks travel under P's version, which must be this engine's
        handoff.check_for(boot.room, prompt_token_ids)
        # mooncake: P writes its blocks into the engine's as it admits the request (store: they are storage hits)
        remote = None if self.te is None else await self.te.remote(boot, deadline)
        ends = handoff.finish_reason != "length" or params.max_tokens == 1
        if ends:  # D computes the prompt's rows; its own token is replaced by P's
            run_ids = list(prompt_token_ids)
            run = dataclasses.replace(params, max_tokens=1, min_tokens=0)
        else:
            run_ids = [*prompt_token_ids, handoff.token_id]
            run = dataclasses.replace(params, max_tokens=params.max_tokens - 1,
                                      min_tokens=max(params.min_tokens - 1, 0))
        rewrite = _FirstToken(handoff, prompt_token_ids, replace=ends, keep_stop_text=params.include_stop_str_in_output)
        try:
            async for delta in self.engine.generate(request_id, run_ids, run, prompt, rewrite=rewrite,
                                                    weight_version=handoff.weight_version, remote_blocks=remote,
                                                    peer_prompt_tokens=len(prompt_token_ids)):  # fmt: skip
                if remote is not None and self.te is not None:  # admitted and loaded: the room is done with
                    self._releases.add(task := asyncio.create_task(self.te.release(boot)))
                    task.add_done_callback(self._releases.discard)
                    remote = None
                yield delta
        except EngineWeightVersionError as e:  # one of P and D was updated, not the other: nothing ran
            raise HandoffError(f"room {boot.room} was computed by the prefill server: {e}; {UPDATE_BOTH}") from None


class _FirstToken:
    """Puts P's first token in front of D's output, on the engine's deltas before they are detokenized:
    the first delta gets the original prompt ids and the token (with P's logprob); weight-version spans
    count it. With replace=True D's one token is P's instead, ending as P's did."""

    def __init__(self, handoff: Handoff, prompt_token_ids: list[int], replace: bool, keep_stop_text: bool) -> None:
        self.handoff, self.prompt_token_ids, self.replace = handoff, prompt_token_ids, replace
        self.keep_stop_text = keep_stop_text
        self.first = True

    def __call__(self, delta: RequestDelta) -> RequestDelta:
        h = self.handoff
        for c in delta.outputs:
            c.weight_versions = [WeightVersionSpan(s.version, 0 if s.start == 0 else s.start + 1, s.end + 1)
                                 for s in c.weight_versions]
        if delta.prompt_token_ids is not None:
            delta.prompt_token_ids = list(self.prompt_token_ids)
        for c in delta.outputs:
            # the first delta that carries a token or an end: an earlier one (the prompt's, no token yet)
            # has no text rule of its own, and the token must be detokenized with the ones after it
            if not self.first or c.error is not None or not (c.token_ids or c.finish_reason is not None):
                continue
            self.first = False
            logprobs = [h.logprob] if h.logprob is not None else None
            if self.replace:
                c.token_ids, c.text, c.text_rule = [h.token_id], h.text, TextRule.IN_TEXT
                c.finish_reason, c.stop_reason = h.finish_reason, h.stop_reason
                c.logprobs = logprobs if c.logprobs is not None else None
            else:
                c.token_ids = [h.token_id, *c.token_ids]
                if c.logprobs is not None and logprobs is not None:
                    c.logprobs = logprobs + list(c.logprobs)
        for c in delta.outputs:
            if c.text_rule is TextRule.IN_TEXT and c.token_ids and not (self.replace and not self.first):
                # the engine decoded D's tokens without P's in front: the receiver decodes them all
                # again, as the engine would have (no stop strings here: a "stop" is a stop token)
                c.text = ""
                c.text_rule = (TextRule.PUSH if c.finish_reason is None else TextRule.PUSH_BUT_LAST_FLUSH
                               if c.finish_reason == "stop" and not self.keep_stop_text else TextRule.PUSH_FLUSH)
        return delta


def _check_pd_params(params: SamplingParams) -> None:
    """What this first slice of PD cannot serve exactly as a colocated server would: refused by name."""
    refused = {
        "n": params.n != 1,
        "stop (strings)": bool(params.stop),
        "presence_penalty": params.presence_penalty != 0.0,
        "frequency_penalty": params.frequency_penalty != 0.0,
        "prompt_logprobs (echo with logprobs)": params.prompt_logprobs is not None,
    }
    names = [name for name, bad in refused.items() if bad]
    if names:
        raise InvalidRequestError(f"{', '.join(names)} cannot be served through prefill/decode disaggregation yet "
                                  "(docs/pd.md); send the request to a server with --disaggregation-mode null")


def run_request(role: PdPrefill | PdDecode | None, engine: AsyncEngineClient, request_id: str,
                prompt_token_ids: list[int], params: SamplingParams, prompt: str | None, boot: Bootstrap | None,
                deadline: float) -> AsyncIterator[RequestDelta]:
    """The deltas of one request: through its role when it carries bootstrap fields, else the engine's."""
    if role is None or boot is None:
        return engine.generate(request_id, prompt_token_ids, params, prompt)
    return role.generate(request_id, prompt_token_ids, params, prompt, boot, deadline)


__all__ = ["HandoffError", "PdDecode", "PdPrefill", "add_pd_args", "check_pd_flags", "pd_engine_fields", "run_request",
           "start_pd_role"]
