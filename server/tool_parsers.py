"""tool_choice AUTO through vLLM's own tool-call parsers (`--tool-call-parser NAME`, as `vllm serve` names them):
the factory made once at start-up (importing them takes seconds and half a GiB), a fresh parser per answer.
server/tools.py streams what they find as tool-call deltas.
"""

from __future__ import annotations

from typing import Any

from tokenline.server.tools import ToolSpec


class VllmToolParsers:
    """tool_choice AUTO: one of vLLM's tool-call parsers (`--tool-call-parser NAME`, as `vllm serve` names them),
    a fresh one per answer. Importing vLLM's parsers takes seconds and half a GiB: done once, at start-up."""

    def __init__(self, name: str, tokenizer: Any):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        try:
            self.parser_class = ToolParserManager.get_tool_parser(name)
        except KeyError:
            known = ", ".join(sorted(ToolParserManager.list_registered()))
            raise ValueError(f"--tool-call-parser {name!r} is not one of vLLM's tool parsers: {known}") from None
        self.name, self.tokenizer, self._request_class = name, tokenizer, ChatCompletionRequest

    def __call__(self, spec: ToolSpec) -> _VllmParser:
        request = self._request_class(
            messages=[{"role": "user", "content": ""}], tool_choice="auto",
            tools=[{"type": "function", "function": {"name": t.name, "description": t.description,
                                                     "parameters": t.parameters}} for t in spec.tools])
        parser = self.parser_class(self.tokenizer, request.tools)
        return _VllmParser(parser, parser.adjust_request(request))


class _VllmParser:
    def __init__(self, parser: Any, request: Any):
        self.parser, self.request = parser, request

    def stream(self, previous: str, current: str, delta: str) -> Any:
        return self.parser.extract_tool_calls_streaming(previous, current, delta, [], [], [], self.request)

    def remaining(self) -> str:
        return self.parser.get_remaining_unstreamed_args()
