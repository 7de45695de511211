"""The syntax of the mock's little shell: words, quotes, `$VAR`, pipelines, `;`, `&&`, `||`
and redirections. Enough for `kubectl cp`, scripts in tests and an interactive session."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Var:
    name: str


@dataclass(frozen=True, slots=True)
class Op:
    value: str


Word = tuple[str | Var, ...]
_REDIRECTIONS = {"<", ">", ">>", "2>", "2>>"}
_DUPLICATIONS = {"2>&1": "stderr to stdout", "1>&2": "stdout to stderr", ">&2": "stdout to stderr"}
_OPERATORS = (*_DUPLICATIONS, "2>>", "&&", "||", ">>", "2>", "|", ";", "&", ">", "<", "\n")
_VARIABLE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*|[0-9?$#])\}|([A-Za-z_][A-Za-z0-9_]*|[0-9?$#])")
_NO_SUBSTITUTION = "command substitution is not supported by the mock"
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


class ShellSyntaxError(Exception):
    pass


class _Lexer:
    """Words and operators of a script, quotes and escapes resolved. `$NAME` stays a Var, to
    be expanded when its command runs (so that `false; echo $?` sees the right status)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.tokens: list[Op | Word] = []
        self.parts: list[str | Var] = []
        self.chars: list[str] = []
        self.in_word = False

    def run(self) -> list[Op | Word]:
        text = self.text
        while self.pos < len(text):
            c = text[self.pos]
            if c in " \t\r":
                self._end_word()
                self.pos += 1
            elif c == "#" and not self.in_word:
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            elif c == "\\":
                following = text[self.pos + 1 : self.pos + 2]
                if following != "\n":  # a backslash-newline continues the line
                    self._literal(following or "\\")
                self.pos += 2
            elif c == "'":
                end = text.find("'", self.pos + 1)
                if end < 0:
                    raise ShellSyntaxError("unterminated quoted string")
                self._literal(text[self.pos + 1 : end])
                self.pos = end + 1
            elif c == '"':
                self._double_quoted()
            elif c == "$":
                self._dollar()
            elif c == "`":
                raise ShellSyntaxError(_NO_SUBSTITUTION)
            elif (op := self._operator()) is not None:
                self._end_word()
                self.tokens.append(Op(op))
                self.pos += len(op)
            else:
                self._literal(c)
                self.pos += 1
        self._end_word()
        return self.tokens

    def _literal(self, text: str) -> None:
        self.chars.append(text)
        self.in_word = True

    def _flush(self) -> None:
        if self.chars:
            self.parts.append("".join(self.chars))
            self.chars = []

    def _end_word(self) -> None:
        self._flush()
        if self.in_word:
            self.tokens.append(tuple(self.parts))
        self.parts = []
        self.in_word = False

    def _double_quoted(self) -> None:
        text = self.text
        self.in_word = True
        self.pos += 1
        while self.pos < len(text):
            c = text[self.pos]
            if c == '"':
                self.pos += 1
                return
            following = text[self.pos + 1 : self.pos + 2]
            if c == "\\" and following in ('"', "\\", "$", "`", "\n"):
                if following != "\n":
                    self._literal(following)
                self.pos += 2
            elif c == "$":
                self._dollar()
            elif c == "`":
                raise ShellSyntaxError(_NO_SUBSTITUTION)
            else:
                self._literal(c)
                self.pos += 1
        raise ShellSyntaxError("unterminated quoted string")

    def _dollar(self) -> None:
        if self.text.startswith("$(", self.pos):
            raise ShellSyntaxError(_NO_SUBSTITUTION)
        match = _VARIABLE.match(self.text, self.pos + 1)
        if match is None:
            self._literal("$")
            self.pos += 1
            return
        self._flush()
        self.parts.append(Var(match.group(1) or match.group(2)))
        self.in_word = True
        self.pos = match.end()

    def _operator(self) -> str | None:
        for op in _OPERATORS:
            if op[0] in "12" and self.in_word:
                continue  # "a2>f" is the word "a2", then ">"
            if self.text.startswith(op, self.pos):
                return op
        return None


@dataclass
class Command:
    words: list[Word] = field(default_factory=list)
    redirections: list[tuple[str, Word | None]] = field(default_factory=list)  # None: dup


# Pipelines, each with what connects it to the one before: None (";", newline), "&&" or "||".
Program = list[tuple[str | None, list[Command]]]


def _describe(token: Op | Word | None) -> str:
    if token is None:
        return "end of input"
    if isinstance(token, Op):
        return "newline" if token.value == "\n" else repr(token.value)
    return "word"


def parse(script: str) -> Program:
    tokens = _Lexer(script).run()
    program: Program = []
    pipeline: list[Command] = []
    command = Command()
    connector: str | None = None
    index = 0
    while index < len(tokens):
        token = tokens[index]
        index += 1
        if not isinstance(token, Op):
            command.words.append(token)
            continue
        op = token.value
        if op in _DUPLICATIONS:
            command.redirections.append((op, None))
        elif op in _REDIRECTIONS:
            target = tokens[index] if index < len(tokens) else None
            if target is None or isinstance(target, Op):
                raise ShellSyntaxError(f"unexpected {_describe(target)} after {op}")
            command.redirections.append((op, target))
            index += 1
        elif op == "&":
            raise ShellSyntaxError("background jobs (&) are not supported by the mock")
        elif not (command.words or command.redirections):
            if op != "\n":  # blank lines, and a newline after "|", "&&" or "||", are fine
                raise ShellSyntaxError(f"unexpected {_describe(token)}")
        elif op == "|":
            pipeline.append(command)
            command = Command()
        else:
            pipeline.append(command)
            program.append((connector, pipeline))
            pipeline, command = [], Command()
            connector = op if op in ("&&", "||") else None
    if command.words or command.redirections:
        pipeline.append(command)
        program.append((connector, pipeline))
    elif pipeline or connector:
        raise ShellSyntaxError("unexpected end of input")
    return program
