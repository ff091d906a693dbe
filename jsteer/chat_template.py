"""Chat templates: render a conversation into prompt text, as transformers' ``apply_chat_template``.

A template is a Jinja string (``tokenizer_config.json``'s ``chat_template``, a folder's
``chat_template.jinja``, or GGUF's ``tokenizer.chat_template``). It is rendered in the same
environment transformers builds: a sandbox with ``trim_blocks`` / ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that does not escape HTML, the globals
``raise_exception`` and ``strftime_now``, and ``{% generation %}`` blocks rendered as their body.
The template sees ``messages``, ``add_generation_prompt``, ``tools``, ``documents``, the
special-token strings (``bos_token``, ``eos_token``, ...) and any extra keyword arguments.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any, Mapping, Optional, Sequence


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for masks): its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def render(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = False,
    special_tokens: Optional[Mapping[str, str]] = None,
    tools=None,
    documents=None,
    **kwargs,
) -> str:
    """The prompt text for ``messages`` ([{"role": ..., "content": ...}, ...]).

    ``special_tokens``: {"bos_token": "<s>", ...}; ``kwargs`` override them (as in transformers).
    Keys whose value is None are dropped from each message, as transformers does. A template's
    ``raise_exception`` surfaces as ``jinja2.TemplateError``."""
    if isinstance(messages, (str, bytes)) or not messages:
        raise ValueError("apply_chat_template needs a non-empty list of messages ({'role': ..., 'content': ...})")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"apply_chat_template: messages[{i}] is a {type(m).__name__}, not a dict")
        chat.append({k: v for k, v in m.items() if v is not None})
    context = {**(special_tokens or {}), **kwargs}
    return _compile(template).render(
        messages=chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt, **context
    )


__all__ = ["render"]
