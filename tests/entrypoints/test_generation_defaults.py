"""OpenAI requests take the model's generation_config.json sampling defaults (ModelConfig.generation_defaults)
for the fields they leave unset, as vLLM does; a field the request sets, even to the OpenAI default, wins."""

from __future__ import annotations

from fastdeploy_r3.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}
MESSAGES = [{"role": "user", "content": "hi"}]


def _sampling(params) -> tuple[float, float, int]:  # noqa: ANN001 - SamplingParams
    return params.temperature, params.top_p, params.top_k


def test_unset_fields_take_the_model_defaults() -> None:
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES})
    assert _sampling(request.to_sampling_params(16, DEFAULTS)) == (0.7, 0.9, 20)


def test_fields_the_request_sets_win() -> None:
    request = CompletionRequest.model_validate({"prompt": "x", "temperature": 1.0, "top_k": 0})
    assert _sampling(request.to_sampling_params(16, DEFAULTS)) == (1.0, 0.9, 0)
    greedy = ChatCompletionRequest.model_validate({"messages": MESSAGES, "temperature": 0})
    assert _sampling(greedy.to_sampling_params(16, DEFAULTS)) == (0.0, 0.9, 20)


def test_without_model_defaults_the_openai_defaults_apply() -> None:
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES})
    assert _sampling(request.to_sampling_params(16)) == (1.0, 1.0, 0)


def test_the_models_max_new_tokens_only_lowers_the_servers_default() -> None:
    """generation_config.json max_new_tokens=50: a chat with room for 200 gets 50, with room for 30 gets 30;
    a request that names its max tokens gets them."""
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES})
    assert request.to_sampling_params(200, {"max_tokens": 50}).max_tokens == 50
    assert request.to_sampling_params(30, {"max_tokens": 50}).max_tokens == 30
    named = ChatCompletionRequest.model_validate({"messages": MESSAGES, "max_completion_tokens": 80})
    assert named.to_sampling_params(200, {"max_tokens": 50}).max_tokens == 80


def test_chat_requests_accept_tools() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    assert ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": tools}).tools == tools
