"""The structured frontend language (seed 001's "structured language frontend").

    import radixlm.lang as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(radixlm.Engine())      # or sgl.RuntimeEndpoint(url)
    print(qa.run(question="What is 2 + 2?")["answer"])

See docs/frontend.md.
"""

from __future__ import annotations

from typing import Any

from radixlm.lang.backend import Backend, EngineBackend, RuntimeEndpoint
from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.interpreter import ForkGroup, ProgramState
from radixlm.lang.ir import assistant, gen, role_begin, role_end, select, system, user
from radixlm.lang.program import (
    SglFunction,
    function,
    get_default_backend,
    set_default_backend,
)


def __getattr__(name: str) -> Any:
    if name == "Engine":  # lazy: importing the language must not load torch models
        from radixlm.engine import Engine
        return Engine
    raise AttributeError(name)


__all__ = ["Backend", "ChatTemplate", "Engine", "EngineBackend", "ForkGroup", "ProgramState",
           "RuntimeEndpoint", "SglFunction", "assistant", "function", "gen",
           "get_default_backend", "role_begin", "role_end", "select", "set_default_backend",
           "system", "user"]
