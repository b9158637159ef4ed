"""Token-level conversation building from a tokenizer's chat template, without re-tokenising.

The first prompt is rendered once with the chat template. After that the conversation only grows:
the model's output ids are appended exactly as sampled, and each observation is appended as a
*delta*: the template's tokens that close the assistant turn, the observation turn, and the
opening of the next assistant turn. Earlier text is never rendered or tokenised again, so the
tokens the trainer sees are exactly the tokens the engine saw (re-tokenisation drift is a
recurring cause of broken token-in-token-out in RL stacks).

The delta is found by rendering a stand-in conversation whose assistant turn is a marker and
whose last turn is the real observation, then taking the text after the marker. Rendering the
marker in history position (followed by a user turn) matters: templates such as Qwen3's format a
past assistant turn differently from the latest one.
"""

from __future__ import annotations

from typing import Any

_MARKER = "<<agentrl-assistant-turn-7c1e>>"
_STAND_IN_USER = "task"
# How many of the delta's first tokens the model may already have produced (e.g. its eos).
_MAX_OVERLAP = 4


class ChatTokens:
    """Builds the token ids of a multi-turn episode for one tokenizer and system prompt."""

    def __init__(self, tokenizer: Any, system_prompt: str, observation_role: str = "user"):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} has no chat template; the agent needs one "
                "(load the model's tokenizer with its tokenizer_config.json / chat_template.jinja)"
            )
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.observation_role = observation_role

    def prompt_ids(self, first_observation: str) -> list[int]:
        """The system prompt and the env's first observation, ending with the assistant's opening."""
        messages = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": first_observation},
        ]
        return self._encode(self._render(messages))

    def observation_ids(self, last_output_ids: list[int], observation: str) -> list[int]:
        """Ids to append after the model's last turn so that the next turn sees `observation`.

        If the model already produced the template's first closing tokens (its end-of-turn
        token, usually), those are not repeated."""
        messages = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": _STAND_IN_USER},
            {"role": "assistant", "content": _MARKER},
            {"role": self.observation_role, "content": observation},
        ]
        rendered = self._render(messages)
        if rendered.count(_MARKER) != 1:
            raise ValueError("the chat template does not render an assistant turn's content verbatim")
        delta = self._encode(rendered.split(_MARKER, 1)[1])
        return delta[self._already_produced(last_output_ids, delta) :]

    def _render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _encode(self, text: str) -> list[int]:
        # The template writes its own special tokens (bos, role tokens): add none.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _already_produced(self, output_ids: list[int], delta: list[int]) -> int:
        """How many of the delta's first ids the model's turn already ends with.

        Usually its end-of-turn token (k=1). A model may also stop on the *next* role token
        (GLM-style templates stop on <|user|>/<|observation|>); when the output ends with a
        special token that appears early in the delta, the delta continues after it, so the
        turn is closed the way the model closed it."""
        for k in range(min(_MAX_OVERLAP, len(output_ids), len(delta)), 0, -1):
            if output_ids[-k:] == delta[:k]:
                return k
        if output_ids and output_ids[-1] in set(self.tokenizer.all_special_ids):
            head = delta[:_MAX_OVERLAP]
            if output_ids[-1] in head:
                return head.index(output_ids[-1]) + 1
        return 0
