"""The mock's commands: a little shell and the built-in commands it runs, against a container's
in-memory files. `MockProvider.exec_in_container` lists what they understand."""

from __future__ import annotations

import asyncio
import functools
import posixpath
import re
from collections.abc import Awaitable, Callable

from ...sdk.capabilities import AttachIO, OutputStream
from ._fs import Filesystem, FsError, NoSpace, join
from ._records import MockContainer, MockPod
from ._syntax import ASSIGNMENT, Command, ShellSyntaxError, Word, parse
from ._tar import tar
from ._terminal import (
    BytesInput,
    Collector,
    LineReader,
    Stdio,
    Terminal,
    read_all,
    say,
    unless,
    write_all,
)

_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def environment(mock: MockPod, container: MockContainer) -> dict[str, str]:
    """What `env` shows in a container: PATH and HOSTNAME first, then the resolved env."""
    env = {"PATH": _PATH, "HOSTNAME": mock.name}
    env.update(container.env)
    env.setdefault("HOME", "/root")
    return env


async def run_command(
    fs: Filesystem,
    env: dict[str, str],
    hostname: str,
    command: list[str],
    io: AttachIO,
    stopped: asyncio.Event,
) -> int:
    """`command`'s exit code: 130 if ^C ended it (with a TTY), 137 if `stopped` was set first."""
    async with Terminal(io) as terminal:
        shell = Shell(fs, env, hostname, terminal)

        async def run() -> int:
            code = await terminal.foreground(shell.main(command, terminal.stdio))
            return 128 + 2 if code is None else code  # ^C: killed by SIGINT

        code = await unless(stopped, run())
        return 128 + 9 if code is None else code  # the pod stopped: SIGKILL


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class _FileOutput:
    """`> file`: each write appends to the file (which the redirection created empty)."""

    def __init__(self, fs: Filesystem, path: str) -> None:
        self._fs = fs
        self._path = path

    async def write(self, data: bytes) -> None:
        self._fs.write(self._path, data, append=True)


def _assignments(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """The leading `NAME=value` words, and the words after them."""
    assigned: dict[str, str] = {}
    while words and ASSIGNMENT.match(words[0]):
        name, _, value = words[0].partition("=")
        assigned[name] = value
        words = words[1:]
    return assigned, words


def _flags_and_operands(args: list[str]) -> tuple[str, list[str]]:
    """The letters of the `-xyz` options, and the other arguments ("-" is one: stdin)."""
    flags = "".join(a[1:] for a in args if a.startswith("-") and a != "-")
    return flags, [a for a in args if not a.startswith("-") or a == "-"]


_Builtin = Callable[[list[str], Stdio], Awaitable[int]]


class Shell:
    """Runs commands as a shell in the container would, with built-in commands only."""

    def __init__(
        self, fs: Filesystem, env: dict[str, str], hostname: str, terminal: Terminal
    ) -> None:
        self.fs = fs
        self.env = env
        self.hostname = hostname
        self.terminal = terminal
        self.cwd = "/"
        self.status = 0
        self._builtins: dict[str, _Builtin] = {
            ":": self._true,
            "[": self._bracket,
            "bash": self._sh,
            "cat": self._cat,
            "cd": self._cd,
            "echo": self._echo,
            "env": self._env,
            "exit": self._exit,
            "export": self._export,
            "false": self._false,
            "head": functools.partial(self._slice, "head"),
            "hostname": self._hostname,
            "ls": self._ls,
            "mkdir": self._mkdir,
            "printenv": self._printenv,
            "pwd": self._pwd,
            "rm": self._rm,
            "sh": self._sh,
            "sleep": self._sleep,
            "stty": self._stty,
            "tail": functools.partial(self._slice, "tail"),
            "tar": self._tar,
            "test": self._test,
            "true": self._true,
            "wc": self._wc,
            "whoami": self._whoami,
        }

    def _path(self, name: str) -> str:
        return join(self.cwd, name)

    async def main(self, argv: list[str], stdio: Stdio) -> int:
        """The session's command; `exit N` included."""
        try:
            return await self.run(argv, stdio)
        except _Exit as done:
            return done.code

    async def run(self, argv: list[str], stdio: Stdio) -> int:
        name = posixpath.basename(argv[0]) if argv else ""
        builtin = self._builtins.get(name)
        if builtin is None:
            await say(stdio.stderr, f"mock: {argv[0] if argv else ''}: command not found")
            return 127
        try:
            return await builtin(argv[1:], stdio)
        except NoSpace:
            await say(stdio.stderr, f"{name}: write error: No space left on device")
            return 1

    async def run_script(self, script: str, stdio: Stdio) -> int:
        try:
            program = parse(script)
        except ShellSyntaxError as exc:
            await say(stdio.stderr, f"sh: syntax error: {exc}")
            self.status = 2
            return 2
        for connector, pipeline in program:
            if (connector == "&&" and self.status != 0) or (connector == "||" and self.status == 0):
                continue
            self.status = await self._pipeline(pipeline, stdio)
        return self.status

    async def interactive(self, stdio: Stdio) -> int:
        """Commands line by line (with a prompt on a terminal) until `exit` or end of input."""
        reader = LineReader(stdio.stdin)
        session = Stdio(reader, stdio.stdout, stdio.stderr)
        tty = self.terminal.tty
        while True:
            if tty:
                await stdio.stdout.write(f"{self.cwd} # ".encode())
            line = await self.terminal.foreground(reader.readline())
            if line is None:
                continue  # ^C at the prompt: a fresh one
            if not line:
                if tty:
                    await stdio.stdout.write(b"exit\n")
                return self.status
            script = line.decode(errors="replace")
            if await self.terminal.foreground(self.run_script(script, session)) is None:
                self.status = 128 + 2

    async def _pipeline(self, pipeline: list[Command], stdio: Stdio) -> int:
        """The stages run one after the other, each reading all the one before wrote."""
        status = 0
        stdin = stdio.stdin
        for index, command in enumerate(pipeline):
            out: OutputStream = stdio.stdout if index == len(pipeline) - 1 else Collector()
            status = await self._simple(command, Stdio(stdin, out, stdio.stderr))
            if isinstance(out, Collector):
                stdin = BytesInput(bytes(out.data))
        return status

    async def _simple(self, command: Command, stdio: Stdio) -> int:
        assignments, words = _assignments([self._expand(word) for word in command.words])
        stdin, stdout, stderr = stdio.stdin, stdio.stdout, stdio.stderr
        for op, target in command.redirections:
            if target is None:  # 2>&1, >&2
                if op == "2>&1":
                    stderr = stdout
                else:
                    stdout = stderr
                continue
            name = self._expand(target)
            path = self._path(name)
            if op == "<":
                try:
                    stdin = BytesInput(self.fs.read(path))
                except FsError as exc:
                    await say(stderr, f"sh: can't open {name}: {exc}")
                    return 1
                continue
            if self.fs.is_dir(path) or not self.fs.is_dir(posixpath.dirname(path)):
                reason = "Is a directory" if self.fs.is_dir(path) else "nonexistent directory"
                await say(stderr, f"sh: can't create {name}: {reason}")
                return 1
            if not op.endswith(">>") or not self.fs.is_file(path):
                self.fs.write(path, b"")
            if op.startswith("2"):
                stderr = _FileOutput(self.fs, path)
            else:
                stdout = _FileOutput(self.fs, path)
        if not words:
            self.env.update(assignments)
            return 0
        return await self._run_with(
            {**self.env, **assignments}, words, Stdio(stdin, stdout, stderr)
        )

    async def _run_with(self, env: dict[str, str], argv: list[str], stdio: Stdio) -> int:
        """`argv` run with `env` in place of the shell's environment."""
        saved, self.env = self.env, env
        try:
            return await self.run(argv, stdio)
        finally:
            self.env = saved

    def _expand(self, word: Word) -> str:
        return "".join(p if isinstance(p, str) else self._variable(p.name) for p in word)

    def _variable(self, name: str) -> str:
        special = {"?": str(self.status), "$": "1", "#": "0", "0": "sh"}
        return special.get(name) or self.env.get(name, "")

    # -- built-in commands: each takes its arguments and stdio and returns an exit code -------
    async def _true(self, args: list[str], stdio: Stdio) -> int:
        return 0

    async def _false(self, args: list[str], stdio: Stdio) -> int:
        return 1

    async def _exit(self, args: list[str], stdio: Stdio) -> int:
        code = self.status
        if args:
            try:
                code = int(args[0])
            except ValueError:
                await say(stdio.stderr, f"sh: exit: {args[0]}: numeric argument required")
                code = 2
        raise _Exit(code & 0xFF)

    async def _echo(self, args: list[str], stdio: Stdio) -> int:
        end = "\n"
        if args and args[0] == "-n":
            args, end = args[1:], ""
        await stdio.stdout.write((" ".join(args) + end).encode())
        return 0

    async def _env(self, args: list[str], stdio: Stdio) -> int:
        assignments, args = _assignments(args)
        env = {**self.env, **assignments}
        if args:
            return await self._run_with(env, args, stdio)
        await stdio.stdout.write("".join(f"{k}={v}\n" for k, v in env.items()).encode())
        return 0

    async def _printenv(self, args: list[str], stdio: Stdio) -> int:
        if not args:
            return await self._env([], stdio)
        values = [self.env[name] for name in args if name in self.env]
        await stdio.stdout.write("".join(f"{v}\n" for v in values).encode())
        return 0 if len(values) == len(args) else 1

    async def _export(self, args: list[str], stdio: Stdio) -> int:
        for arg in args:
            name, assigned, value = arg.partition("=")
            if assigned:
                self.env[name] = value
        return 0

    async def _hostname(self, args: list[str], stdio: Stdio) -> int:
        await say(stdio.stdout, self.hostname)
        return 0

    async def _whoami(self, args: list[str], stdio: Stdio) -> int:
        await say(stdio.stdout, "root")
        return 0

    async def _pwd(self, args: list[str], stdio: Stdio) -> int:
        await say(stdio.stdout, self.cwd)
        return 0

    async def _cd(self, args: list[str], stdio: Stdio) -> int:
        name = args[0] if args else self.env.get("HOME", "/")
        path = self._path(name)
        if not self.fs.is_dir(path):
            reason = "Not a directory" if self.fs.is_file(path) else "No such file or directory"
            await say(stdio.stderr, f"sh: cd: {name}: {reason}")
            return 1
        self.cwd = path
        return 0

    async def _sleep(self, args: list[str], stdio: Stdio) -> int:
        if not args:
            await say(stdio.stderr, "sleep: missing operand")
            return 1
        total = 0.0
        units = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
        for arg in args:
            match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+|infinity)([smhd]?)", arg)
            if match is None:
                await say(stdio.stderr, f"sleep: invalid time interval '{arg}'")
                return 1
            total += float(match.group(1).replace("infinity", "inf")) * units[match.group(2)]
        await asyncio.sleep(min(total, 1e9))
        return 0

    async def _cat(self, args: list[str], stdio: Stdio) -> int:
        status = 0
        for name in [a for a in args if a != "-u"] or ["-"]:
            if name == "-":
                while data := await stdio.stdin.read():
                    await stdio.stdout.write(data)
                continue
            try:
                data = self.fs.read(self._path(name))
            except FsError as exc:
                await say(stdio.stderr, f"cat: {name}: {exc}")
                status = 1
                continue
            await write_all(stdio.stdout, data)
        return status

    async def _ls(self, args: list[str], stdio: Stdio) -> int:
        flags, names = _flags_and_operands(args)
        show_all = "a" in flags
        names = names or ["."]
        status = 0
        files: list[str] = []
        directories: list[tuple[str, str]] = []
        for name in names:
            path = self._path(name)
            if self.fs.is_dir(path):
                directories.append((name, path))
            elif self.fs.is_file(path):
                files.append(name)
            else:
                await say(stdio.stderr, f"ls: cannot access '{name}': No such file or directory")
                status = 2
        lines = sorted(files)
        for name, path in directories:
            entries = self.fs.listdir(path)
            entries = [".", "..", *entries] if show_all else [e for e in entries if e[0] != "."]
            if len(names) > 1:
                lines += ["", f"{name}:"] if lines else [f"{name}:"]
            lines += entries
        await stdio.stdout.write("".join(f"{line}\n" for line in lines).encode())
        return status

    async def _bracket(self, args: list[str], stdio: Stdio) -> int:
        if not args or args[-1] != "]":
            await say(stdio.stderr, "[: missing ]")
            return 2
        return await self._test(args[:-1], stdio)

    async def _test(self, args: list[str], stdio: Stdio) -> int:
        try:
            return 0 if self._evaluate(args) else 1
        except ValueError as exc:
            await say(stdio.stderr, f"test: {exc}")
            return 2

    def _evaluate(self, args: list[str]) -> bool:
        fs = self.fs
        match args:
            case []:
                return False
            case ["!", *rest]:
                return not self._evaluate(rest)
            case [value]:
                return value != ""
            case ["-n", value]:
                return value != ""
            case ["-z", value]:
                return value == ""
            case ["-e" | "-r" | "-w", name]:
                return fs.exists(self._path(name))
            case ["-d" | "-x", name]:
                return fs.is_dir(self._path(name))
            case ["-f", name]:
                return fs.is_file(self._path(name))
            case ["-s", name]:
                return bool(fs.files.get(self._path(name)))
            case [left, "=" | "==", right]:
                return left == right
            case [left, "!=", right]:
                return left != right
            case [left, "-eq" | "-ne" | "-lt" | "-le" | "-gt" | "-ge" as op, right]:
                try:
                    a, b = int(left), int(right)
                except ValueError:
                    raise ValueError("integer expression expected") from None
                results = {"-eq": a == b, "-ne": a != b, "-lt": a < b}
                results |= {"-le": a <= b, "-gt": a > b, "-ge": a >= b}
                return results[op]
            case _:
                raise ValueError(f"unknown condition: {' '.join(args)}")

    async def _mkdir(self, args: list[str], stdio: Stdio) -> int:
        parents = any(a.startswith("-") and "p" in a for a in args)
        names = [a for a in args if not a.startswith("-")]
        if not names:
            await say(stdio.stderr, "mkdir: missing operand")
            return 1
        status = 0
        for name in names:
            path = self._path(name)
            if self.fs.exists(path):
                if parents and self.fs.is_dir(path):
                    continue
                reason = "File exists"
            elif not parents and not self.fs.is_dir(posixpath.dirname(path)):
                reason = "No such file or directory"
            else:
                try:
                    self.fs.makedirs(path)
                    continue
                except FsError as exc:
                    reason = str(exc)
            await say(stdio.stderr, f"mkdir: cannot create directory '{name}': {reason}")
            status = 1
        return status

    async def _rm(self, args: list[str], stdio: Stdio) -> int:
        flags, names = _flags_and_operands(args)
        recursive, force = "r" in flags or "R" in flags, "f" in flags
        status = 0
        for name in names:
            path = self._path(name)
            if not self.fs.exists(path):
                if force:
                    continue
                reason = "No such file or directory"
            elif self.fs.is_dir(path) and not recursive:
                reason = "Is a directory"
            else:
                self.fs.remove(path)
                continue
            await say(stdio.stderr, f"rm: cannot remove '{name}': {reason}")
            status = 1
        return status

    async def _inputs(
        self, tool: str, names: list[str], stdio: Stdio
    ) -> tuple[list[tuple[str, bytes]], int]:
        """The contents of the named files ("-": stdin; none: stdin) and an exit status."""
        found: list[tuple[str, bytes]] = []
        status = 0
        for name in names or ["-"]:
            if name == "-":
                found.append((name, await read_all(stdio.stdin, 4 * self.fs.limit)))
                continue
            try:
                found.append((name, self.fs.read(self._path(name))))
            except FsError as exc:
                await say(stdio.stderr, f"{tool}: {name}: {exc}")
                status = 1
        return found, status

    async def _slice(self, tool: str, args: list[str], stdio: Stdio) -> int:
        """head and tail: -n N / -c N, and for tail +N (from the Nth line or byte on)."""
        unit, spec, names = "n", "10", []
        rest = iter(args)
        for arg in rest:
            if arg in ("-c", "-n"):
                value = next(rest, None)
                if value is None:
                    await say(stdio.stderr, f"{tool}: option requires an argument -- '{arg[1]}'")
                    return 1
                unit, spec = arg[1], value
            elif re.fullmatch(r"-[cn].+", arg):
                unit, spec = arg[1], arg[2:]
            elif re.fullmatch(r"-\d+", arg):
                spec = arg[1:]
            else:
                names.append(arg)
        match = re.fullmatch(r"([+-]?)(\d+)", spec)
        if match is None:
            what = "bytes" if unit == "c" else "lines"
            await say(stdio.stderr, f"{tool}: invalid number of {what}: '{spec}'")
            return 1
        count = int(match.group(2))
        from_start = tool == "tail" and match.group(1) == "+"
        found, status = await self._inputs(tool, names, stdio)
        data = b"".join(content for _, content in found)
        items: list[bytes] | bytes = data if unit == "c" else data.splitlines(keepends=True)
        if tool == "head":
            items = items[:count]
        elif from_start:
            items = items[max(count - 1, 0) :]
        else:
            items = items[-count:] if count else items[:0]
        await write_all(stdio.stdout, items if isinstance(items, bytes) else b"".join(items))
        return status

    async def _wc(self, args: list[str], stdio: Stdio) -> int:
        flags, names = _flags_and_operands(args)
        chosen = [f for f in "lwc" if f in flags] or ["l", "w", "c"]
        found, status = await self._inputs("wc", names, stdio)
        lines = []
        for name, data in found:
            counts = {"l": data.count(b"\n"), "w": len(data.split()), "c": len(data)}
            label = f" {name}" if names else ""
            lines.append(" ".join(str(counts[f]) for f in chosen) + label)
        await stdio.stdout.write("".join(f"{line}\n" for line in lines).encode())
        return status

    async def _stty(self, args: list[str], stdio: Stdio) -> int:
        if not self.terminal.tty:
            await say(stdio.stderr, "stty: 'standard input': Inappropriate ioctl for device")
            return 1
        if args == ["size"]:
            rows, columns = await self.terminal.window_size()
            await say(stdio.stdout, f"{rows} {columns}")
        return 0  # other settings are accepted and ignored

    async def _tar(self, args: list[str], stdio: Stdio) -> int:
        return await tar(self.fs, self.cwd, args, stdio)

    async def _sh(self, args: list[str], stdio: Stdio) -> int:
        """`sh -c SCRIPT`, `sh FILE`, or interactive (a prompt with a TTY), in a subshell."""
        shell = Shell(self.fs, dict(self.env), self.hostname, self.terminal)
        shell.cwd = self.cwd
        script: str | None = None
        index = 0
        while index < len(args) and args[index].startswith("-") and args[index] != "-":
            flags = args[index]
            index += 1
            if flags == "--":
                break
            if "c" in flags:
                if index >= len(args):
                    await say(stdio.stderr, "sh: -c requires an argument")
                    return 2
                script = args[index]
                break
        try:
            if script is not None:
                return await shell.run_script(script, stdio)
            if index < len(args) and args[index] != "-":
                try:
                    text = self.fs.read(self._path(args[index]))
                except FsError as exc:
                    await say(stdio.stderr, f"sh: {args[index]}: {exc}")
                    return 127
                return await shell.run_script(text.decode(errors="replace"), stdio)
            return await shell.interactive(stdio)
        except _Exit as done:
            return done.code
