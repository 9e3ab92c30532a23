"""The structured-output library's limits, one set for both sides: the gateway's admission check
(services/gateway/grammar_check.py) compiles and walks every grammar under them, and the scheduler's matchers
(services/scheduler/grammar.py) run under the same, so what passed the check compiles the same way there.
"""

from __future__ import annotations

from llguidance import LLParserLimits


def parser_limits() -> LLParserLimits:
    # llguidance's defaults (2,000 Earley items a row, 50,000 a step, lexer fuel, 500,000 grammar symbols), except
    # terse errors: verbose ones dump the parser state and the grammar into the message, which reaches the client
    # and the logs.
    return LLParserLimits(verbose_errors=False)
