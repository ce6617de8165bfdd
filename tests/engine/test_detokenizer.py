"""Incremental detokenisation and the text deltas the engine sends: whole characters only, stop
strings cut across deltas, and the real fake-checkpoint tokenizer agreeing with one full decode."""

from __future__ import annotations

from collections.abc import Callable

from fastdeploy_r3.engine.detokenizer import IncrementalDetokenizer
from fastdeploy_r3.engine.request import Request, RequestStatus
from fastdeploy_r3.engine.token_processor import TokenProcessor
from fastdeploy_r3.engine.tokenizer import Tokenizer
from fastdeploy_r3.sampling_params import SamplingParams


class ByteTokenizer:
    """Token id = one byte, as a byte-level BPE with no merges; counts decoded tokens."""

    def __init__(self) -> None:
        self.decoded_tokens = 0

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded_tokens += len(token_ids)
        return bytes(token_ids).decode("utf-8", errors="replace")


class ReleasingScheduler:
    """What TokenProcessor needs of the Scheduler when R3 is off: release a finished request, and
    advance its cursor over the tokens a multi-token step fed."""

    def __init__(self) -> None:
        self.released: list[tuple[str, RequestStatus]] = []

    def advance(self, req: Request, num_tokens: int) -> None:
        req.num_computed_tokens += num_tokens

    def release(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.released.append((req.request_id, status))


def push_each(det: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [det.push([i]) for i in ids]


def test_a_split_character_is_held_back_until_its_last_byte() -> None:
    """'aé€b' is a, C3 A9, E2 82 AC, b: nothing is emitted for a partial character, never U+FFFD."""
    ids = list("aé€b".encode())
    assert ids == [0x61, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0x62]
    assert push_each(IncrementalDetokenizer(ByteTokenizer()), ids) == ["a", "", "é", "", "", "€", "b"]


def test_each_step_decodes_a_short_window_not_the_whole_output() -> None:
    """400 ASCII tokens: each push decodes at most two tokens twice (prefix and window), not all of them."""
    tok = ByteTokenizer()
    det = IncrementalDetokenizer(tok)
    text = "".join(push_each(det, [ord("x")] * 400))
    assert text == "x" * 400
    assert tok.decoded_tokens <= 400 * 3  # a full decode per step would be 400 * 401 / 2 = 80200


def test_an_incomplete_tail_is_flushed_at_the_end_and_garbage_is_not_held_forever() -> None:
    """A lone lead byte at the end comes out at flush as U+FFFD; a run of invalid bytes is emitted once
    more than 4 tokens are held (no character is that long), so the window stays short."""
    det = IncrementalDetokenizer(ByteTokenizer())
    assert push_each(det, [0x61, 0xC3]) == ["a", ""]
    assert det.flush() == "\ufffd"
    det = IncrementalDetokenizer(ByteTokenizer())
    assert push_each(det, [0xFF] * 6) == ["", "", "", "", "\ufffd" * 5, ""]
    assert det.flush() == "\ufffd"


def test_fake_checkpoint_tokenizer_deltas_join_to_one_full_decode(fake_model_dir: Callable[..., str]) -> None:
    """The real byte-level BPE of the fake checkpoint: 'Grüße, 日本!' spells ü, ß and each CJK
    character with several tokens; the deltas hold no U+FFFD and join to the full decode."""
    tok = Tokenizer(fake_model_dir("qwen3_moe"))
    text = "Grüße, 日本!"
    ids = tok.encode(text)
    assert sum(tok.decode([i]) == "\ufffd" for i in ids) >= 6  # bytes of split characters
    deltas = push_each(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert [d for d in deltas if d and ord(d[-1]) > 127] == ["ü", "ß", "日", "本"]


def feed(tp: TokenProcessor, req: Request, text: str) -> list[str]:
    """Append the bytes of `text` as tokens, taking a delta after each step, as the engine does."""
    deltas = []
    for b in text.encode():
        if req.is_finished:
            break
        tp.append_token(req, b)
        deltas.append(tp.take_delta(req)[0])
    return deltas


def test_stop_string_arriving_over_several_tokens_is_never_streamed() -> None:
    """stop=['END']: while running, the last 2 characters are held back, so 'EN' is never sent; the
    stop cuts the text and the request finishes with stop_reason 'END'."""
    scheduler = ReleasingScheduler()
    tp = TokenProcessor(scheduler, ByteTokenizer(), eos_token_ids=[], max_model_len=1000, routing=None)  # type: ignore[arg-type]
    req = Request("r", [1], SamplingParams(max_tokens=50, stop=["END"]))
    deltas = feed(tp, req, "okéENDtail")
    assert deltas == ["", "", "", "o", "k", "é", ""]
    assert req.status is RequestStatus.FINISHED_STOPPED and tp.output(req).stop_reason == "END"
    assert scheduler.released == [("r", RequestStatus.FINISHED_STOPPED)]
    assert req.output_token_ids == list("okéEND".encode())


def test_length_finish_flushes_the_held_back_text_and_token_ids_go_once() -> None:
    """max_tokens=4 with stop=['zz']: the held character goes out with the finishing delta; every
    token id is sent exactly once across the deltas."""
    tp = TokenProcessor(ReleasingScheduler(), ByteTokenizer(), eos_token_ids=[], max_model_len=1000, routing=None)  # type: ignore[arg-type]
    req = Request("r", [1], SamplingParams(max_tokens=4, stop=["zz"]))
    sent_ids: list[int] = []
    texts = []
    for b in b"abcd":
        tp.append_token(req, b)
        text, ids = tp.take_delta(req)
        texts.append(text)
        sent_ids += ids
    assert texts == ["", "a", "b", "cd"] and req.status is RequestStatus.FINISHED_LENGTH
    assert sent_ids == list(b"abcd")
    assert tp.take_delta(req) == ("", [])


class RecordingTokenizer(ByteTokenizer):
    """ByteTokenizer that keeps the keyword arguments of every decode."""

    def __init__(self) -> None:
        super().__init__()
        self.kwargs: list[dict] = []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True, **kwargs) -> str:
        self.kwargs.append({"skip_special_tokens": skip_special_tokens, **kwargs})
        return super().decode(token_ids, skip_special_tokens)


def test_a_stop_tokens_text_is_trimmed_unless_kept_and_it_stays_in_token_ids() -> None:
    """stop_token_ids=['!'] on 'ok!': the text is 'ok' (vLLM's rule, SGLang's without no_stop_trim), and
    'ok!' with include_stop_str_in_output (SGLang's no_stop_trim); '!' is the last token id either way."""
    for keep, text in ((False, "ok"), (True, "ok!")):
        tp = TokenProcessor(ReleasingScheduler(), ByteTokenizer(), eos_token_ids=[], max_model_len=1000, routing=None)  # type: ignore[arg-type]
        params = SamplingParams(max_tokens=10, stop_token_ids=[ord("!")], include_stop_str_in_output=keep)
        req = Request("r", [1], params)
        assert "".join(feed(tp, req, "ok!more")) == text
        assert req.output_token_ids == list(b"ok!") and tp.output(req).stop_reason == ord("!")


def test_spaces_between_special_tokens_reaches_the_tokenizers_decode() -> None:
    """Sent only when false, so tokenizers whose decode lacks the keyword keep working by default."""
    for flag, expected in ((True, {"skip_special_tokens": False}),
                           (False, {"skip_special_tokens": False, "spaces_between_special_tokens": False})):
        tok = RecordingTokenizer()
        tp = TokenProcessor(ReleasingScheduler(), tok, eos_token_ids=[], max_model_len=1000, routing=None)  # type: ignore[arg-type]
        req = Request("r", [1], SamplingParams(max_tokens=2, skip_special_tokens=False,
                                               spaces_between_special_tokens=flag))
        feed(tp, req, "ab")
        assert tok.kwargs and all(k == expected for k in tok.kwargs)


def test_a_stop_string_inside_one_step_s_tokens_drops_the_tokens_after_it() -> None:
    """One step returns b"aENDxy" (a verify step accepting 5 drafts): the request keeps "aEND", stops
    with "END", and x, y are never appended; the cursor moves over the 3 kept tokens fed as drafts."""
    tp = TokenProcessor(ReleasingScheduler(), ByteTokenizer(), eos_token_ids=[], max_model_len=1000, routing=None)  # type: ignore[arg-type]
    req = Request("r", [1, 2], SamplingParams(max_tokens=50, stop=["END"]))
    req.num_computed_tokens = 2  # the prompt was fed by this step
    assert tp.append_tokens(req, list(b"aENDxy")) == 4
    assert req.output_token_ids == list(b"aEND") and req.num_computed_tokens == 2 + 3
    assert req.status is RequestStatus.FINISHED_STOPPED and tp.output(req).stop_reason == "END"
    assert tp.take_delta(req) == ("a", list(b"aEND"))


def test_an_eos_inside_one_step_s_tokens_before_min_tokens_does_not_stop() -> None:
    """min_tokens=3, eos=9: [9, 5, 9, 7] stops at the second 9 (the third token), 7 is dropped."""
    tp = TokenProcessor(ReleasingScheduler(), None, eos_token_ids=[9], max_model_len=1000, routing=None)  # type: ignore[arg-type]
    req = Request("r", [1], SamplingParams(max_tokens=50, min_tokens=3))
    assert tp.append_tokens(req, [9, 5, 9, 7]) == 3
    assert req.output_token_ids == [9, 5, 9] and req.status is RequestStatus.FINISHED_STOPPED
