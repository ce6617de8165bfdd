"""Per-token log-probabilities as they cross from the worker to the engine, the server and `LLM`.

Definition (one for the whole project; README "Logprobs" says the same):

    sampled tokens   logprob = log_softmax(z / T)[token], z = the model's float32 logits after the
                     request's penalties (repetition, frequency, presence) and min_tokens masking,
                     T = temperature (T = 0, greedy, counts as T = 1). top-k / top-p truncation is
                     NOT applied: the numbers are those of the distribution the truncation starts
                     from, so they stay finite for every token and comparable across top_k / top_p.
    prompt tokens    logprob = log_softmax(raw logits)[token] (no temperature, no penalties): they
                     score given text, as vLLM's prompt_logprobs do.

Two extras a request may ask for (SamplingParams.return_entropy / return_top_p_token_ids):

    entropy          -sum_v p[v] log p[v] of the same distribution (softmax(z / T)), in nats
    kept_ids         the ids the sampler's top-k / top-p truncation kept for this draw, most likely
                     first (greedy: the argmax alone), what slime's custom_params
                     return_top_p_token_ids replays; the sampled token's logprob is then that of
                     the truncated distribution, renormalised over kept_ids (the sampled token is
                     always among them), so the trainer computes the same number over the same set

For comparison: vLLM v1 returns raw logprobs by default (`logprobs_mode="raw_logprobs"`, before
temperature and penalties; "processed_logprobs" is ours minus the truncation); SGLang returns
log_softmax of the logits after temperature scaling (and penalties), also before top-k / top-p.
The numbers are computed on the device in float32; only the chosen token's logprob, its rank and
the top-N alternatives cross to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

# OpenAI's limits: chat top_logprobs <= 20, completions logprobs <= 5; vLLM allows up to 20 on both.
MAX_LOGPROBS = 20


@dataclass
class TokenLogprob:
    """One position of a sequence: the token that is there and how likely it was.

    `top` holds the N most likely tokens of the same distribution, most likely first (N as asked,
    0 for none); the token itself may or may not be among them, as in vLLM and OpenAI.
    """

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token of the distribution
    top: list[tuple[int, float]]  # [(token id, logprob)] * N
    entropy: float | None = None  # only when asked for (SamplingParams.return_entropy)
    kept_ids: list[int] | None = None  # only when asked for (SamplingParams.return_top_p_token_ids)


# prompt logprobs of a request: entry i belongs to prompt token i; entry 0 is None (nothing predicts it)
PromptLogprobs = list[TokenLogprob | None]
