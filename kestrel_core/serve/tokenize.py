"""vLLM's tokenizer endpoints, ``/tokenize`` and ``/detokenize``: the token ids the server itself reads, for the
clients that count, build or check them (RL trainers tokenize a conversation exactly as the chat route will).

``/tokenize`` takes a ``prompt`` (a completion's text; the tokenizer's special tokens, such as a BOS, are added
unless ``add_special_tokens`` is false) or ``messages`` (a chat, rendered by the chat route's own code with its
``tools``, ``chat_template_kwargs`` and ``continue_final_message``; ``add_generation_prompt`` true unless given, false
where the last message is continued; the template writes any BOS, so
``add_special_tokens`` is false unless given) and answers ``count``, ``max_model_len`` (the model's context),
``tokens`` and, with ``return_token_strs``, ``token_strs`` (each token's own text, as logprobs name it).
``/detokenize`` answers the text of ``tokens`` as ``prompt``. Both take ``model`` as the other routes do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, Request
from pydantic import StrictBool, StrictInt, StrictStr

from kestrel_core.errors import KestrelError
from kestrel_core.serve.bodies import RequestBody
from kestrel_core.serve.errors import APIError, from_kestrel_error, validated
from kestrel_core.serve.offload import json_body, off_loop
from kestrel_core.serve.protocol import ChatCompletionRequest

if TYPE_CHECKING:
    from kestrel_core.serve.app import Models, Served


# the chat route's fields that shape its prompt and that vLLM's /tokenize takes too
CHAT_PROMPT_FIELDS = {"messages", "tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"}


class TokenizeBody(RequestBody):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[dict[str, Any]] | None = None  # checked as a chat request's
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool = False

    def token_ids(self, served: Served) -> list[int]:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        tokenizer = served.engine.tokenizer
        try:
            if self.prompt is not None:
                return list(tokenizer.encode(self.prompt, add_special_tokens=self.add_special_tokens is not False))
            chat = validated(ChatCompletionRequest, self.model_dump(include=CHAT_PROMPT_FIELDS))
            prompt, ids, _ = served.chat_prompt(chat)
            return list(tokenizer.encode(prompt, add_special_tokens=True)) if self.add_special_tokens else ids
        except KestrelError as exc:  # a model without a tokenizer
            raise from_kestrel_error(exc, param="prompt") from None


class DetokenizeBody(RequestBody):
    model: StrictStr | None = None
    tokens: list[StrictInt]


def install(app: FastAPI, models: Models) -> None:
    @app.post("/tokenize")
    async def tokenize(body: Annotated[TokenizeBody, json_body(TokenizeBody)], request: Request) -> dict[str, Any]:
        served = models.get(body.model)

        def answer() -> dict[str, Any]:
            ids = body.token_ids(served)
            out: dict[str, Any] = {"count": len(ids), "max_model_len": served.engine.config.max_position,
                                   "tokens": ids}
            if body.return_token_strs:
                out["token_strs"] = [served.tokens(i) for i in ids]
            return out

        return await off_loop(request, answer, inline=False)

    @app.post("/detokenize")
    async def detokenize(body: Annotated[DetokenizeBody, json_body(DetokenizeBody)],
                         request: Request) -> dict[str, str]:
        served = models.get(body.model)

        def text() -> str:
            vocab = served.engine.config.vocab_size
            bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
            try:
                return served.engine.tokenizer.decode(body.tokens)
            except KestrelError as exc:  # a model without a tokenizer
                raise from_kestrel_error(exc, param="tokens") from None

        return {"prompt": await off_loop(request, text)}
