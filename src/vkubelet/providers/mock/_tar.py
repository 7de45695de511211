"""The mock's `tar`: what `kubectl cp` runs, `tar cf - PATH` from the pod and `tar -xmf - -C DIR`
to it, with GNU tar's options and messages (old-style `tar cf`, `z`, `v`, `t` included).

Archives carry the files' modification times, so the same files make the same archive twice
(which `kubectl cp --retries` relies on).
"""

from __future__ import annotations

import posixpath
import tarfile
from dataclasses import dataclass, field
from io import BytesIO

from ._fs import Filesystem, FsError, NoSpace, join
from ._terminal import Stdio, read_all, say, write_all


async def tar(fs: Filesystem, cwd: str, args: list[str], stdio: Stdio) -> int:
    try:
        options = TarOptions.parse(args)
    except ValueError as exc:
        await say(stdio.stderr, f"tar: {exc}")
        return 2
    run = _Tar(fs, cwd, stdio)
    if options.mode == "c":
        return await run.create(options)
    return await run.read(options)


class _Tar:
    """One tar command: where it runs, and what it has reported so far."""

    def __init__(self, fs: Filesystem, cwd: str, stdio: Stdio) -> None:
        self.fs = fs
        self.cwd = cwd
        self.stdio = stdio
        self.status = 0
        self._warned = False

    async def _error(self, text: str) -> None:
        await say(self.stdio.stderr, f"tar: {text}")
        self.status = 2

    async def _member_name(self, name: str) -> str:
        """`name` without leading slashes, which GNU tar says it removes (once)."""
        stripped = name.lstrip("/")
        if stripped != name and not self._warned:
            await say(self.stdio.stderr, "tar: Removing leading `/' from member names")
            self._warned = True
        return stripped

    async def _finish(self) -> int:
        if self.status:
            await say(self.stdio.stderr, "tar: Exiting with failure status due to previous errors")
        return self.status

    async def create(self, options: TarOptions) -> int:
        fs, stdio = self.fs, self.stdio
        if not options.paths:
            await say(stdio.stderr, "tar: Cowardly refusing to create an empty archive")
            return 2
        base = join(self.cwd, options.directory or ".")
        to_stdout = options.archive in (None, "-")
        listing = stdio.stderr if to_stdout else stdio.stdout
        buffer = BytesIO()
        with tarfile.open(
            fileobj=buffer, mode="w:gz" if options.gzip else "w", format=tarfile.GNU_FORMAT
        ) as archive:
            for name in options.paths:
                path = join(base, name)
                if not fs.exists(path):
                    await self._error(f"{name}: Cannot stat: No such file or directory")
                    continue
                member = await self._member_name(name)
                for entry in fs.walk(path):
                    info = tarfile.TarInfo(posixpath.join(member, entry[len(path) :].lstrip("/")))
                    info.name = info.name.rstrip("/") or "."
                    info.mtime = fs.mtimes.get(entry, 0)
                    info.uname = info.gname = "root"
                    content = None
                    if fs.is_dir(entry):
                        info.type, info.mode = tarfile.DIRTYPE, 0o755
                    else:
                        data = fs.read(entry)
                        info.size, info.mode, content = len(data), 0o644, BytesIO(data)
                    archive.addfile(info, content)
                    if options.verbose:
                        await say(listing, info.name + ("/" if info.isdir() else ""))
        if to_stdout:
            await write_all(stdio.stdout, buffer.getvalue())
        else:
            fs.write(join(self.cwd, options.archive or "-"), buffer.getvalue())
        return await self._finish()

    async def read(self, options: TarOptions) -> int:
        """`x` (extract) or `t` (list)."""
        fs, stdio = self.fs, self.stdio
        if options.archive in (None, "-"):
            source = await read_all(stdio.stdin, 2 * fs.limit)
        else:
            try:
                source = fs.read(join(self.cwd, options.archive or "-"))
            except FsError as exc:
                await say(stdio.stderr, f"tar: {options.archive}: Cannot open: {exc}")
                return 2
        base = join(self.cwd, options.directory or ".")
        if not fs.is_dir(base):
            await say(stdio.stderr, f"tar: {options.directory}: Cannot open: No such directory")
            await say(stdio.stderr, "tar: Error is not recoverable: exiting now")
            return 2
        try:
            with tarfile.open(fileobj=BytesIO(source), mode="r:*") as archive:
                for member in archive:
                    if options.mode == "t" or options.verbose:
                        await say(stdio.stdout, member.name + ("/" if member.isdir() else ""))
                    if options.mode == "t":
                        continue
                    name = await self._member_name(member.name)
                    if ".." in name.split("/"):
                        await self._error(f"{member.name}: Member name contains '..'")
                        continue
                    target = join(base, name)
                    try:
                        if member.isdir():
                            fs.makedirs(target)
                        elif member.isfile():
                            extracted = archive.extractfile(member)
                            assert extracted is not None
                            fs.write(target, extracted.read())
                        else:
                            await say(
                                stdio.stderr, f"tar: {member.name}: links are skipped by the mock"
                            )
                    except FsError as exc:
                        await self._error(f"{member.name}: Cannot open: {exc}")
                    except NoSpace:
                        await say(
                            stdio.stderr,
                            f"tar: {member.name}: Cannot write: No space left on device",
                        )
                        return 2
        except tarfile.TarError:
            await self._error("This does not look like a tar archive")
        return await self._finish()


_IGNORED = {
    "no-same-owner",
    "no-same-permissions",
    "same-owner",
    "same-permissions",
    "preserve-permissions",
    "touch",
    "overwrite",
    "numeric-owner",
    "no-overwrite-dir",
}
_LONG = {
    "create": "c",
    "extract": "x",
    "list": "t",
    "file": "f",
    "directory": "C",
    "gzip": "z",
    "verbose": "v",
}


@dataclass
class TarOptions:
    mode: str = ""  # c, x or t
    archive: str | None = None  # "-" or None: stdin/stdout
    directory: str | None = None
    gzip: bool = False
    verbose: bool = False
    paths: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, args: list[str]) -> TarOptions:
        """GNU tar's options, old style (`tar cf - x`) included."""
        args = list(args)
        if args and not args[0].startswith("-"):
            args[0] = "-" + args[0]
        options = cls()
        rest = iter(args)

        def argument(missing: str) -> str:
            value = next(rest, None)
            if value is None:
                raise ValueError(missing)
            return value

        for arg in rest:
            if arg == "--":
                options.paths += rest
                break
            if arg.startswith("--"):
                name, has_value, value = arg[2:].partition("=")
                if name in _IGNORED:
                    continue
                letter = _LONG.get(name)
                if letter is None:
                    raise ValueError(f"unrecognized option '--{name}'")
                if letter in "fC" and not has_value:
                    value = argument(f"option '--{name}' requires an argument")
                options._set(letter, value)
            elif not arg.startswith("-") or arg == "-":
                options.paths.append(arg)
            else:
                letters = arg[1:]
                for position, letter in enumerate(letters):
                    if letter in "fC":  # the rest of the word, or the next one, is its value
                        value = letters[position + 1 :]
                        value = value or argument(f"option requires an argument -- '{letter}'")
                        options._set(letter, value)
                        break
                    if letter not in "mpoh":  # ignored, as the long options in _IGNORED
                        options._set(letter)
        if not options.mode:
            raise ValueError("You must specify one of the '-Acdtrux' options")
        return options

    def _set(self, letter: str, value: str = "") -> None:
        if letter in "cxt":
            if self.mode and self.mode != letter:
                raise ValueError("You may not specify more than one '-Acdtrux' option")
            self.mode = letter
        elif letter == "f":
            self.archive = value
        elif letter == "C":
            self.directory = value
        elif letter == "z":
            self.gzip = True
        elif letter == "v":
            self.verbose = True
        else:
            raise ValueError(f"invalid option -- '{letter}'")
