"""The layers that contain a tool worker (`sandbox.ToolRunner`'s processes), entered once by each
fresh worker before it runs anything (`enter`), with the calls they need from the kernel.

With namespaces (root, or any user where unprivileged user namespaces are enabled):
- **network**: a network namespace of its own whose loopback is down; every connect fails;
- **filesystem**: a mount namespace whose root is a read-only tmpfs holding only the Python
  installation, the code directories on `sys.path`, `/usr`, `/dev/{null,zero,random,urandom}` and
  the worker's scratch directory (the only writable place); no `/proc`, `/etc`, `/home`, `/tmp`,
  workdir or dataset; the host's root is unmounted, not merely hidden, so nothing leads back;
- **processes**: a PID namespace whose init is the worker: tool code sees and signals only its own
  children, every one of them is killed after each call (`reap`), and all of them die with the
  worker when the pool kills it at a timeout or at close (the kernel ends a namespace with its
  init); a process limit (`RLIMIT_NPROC`) bounds a fork bomb in the meantime;
- **privileges**: from root, the worker becomes `nobody` (no capabilities, no groups); otherwise
  it drops the capabilities its user namespace gave it; `no_new_privs` either way.
Without namespaces only a socket guard (Python's `socket` refuses Internet families) and the
process limits apply: `layers()` says which applied, and the runner refuses such a worker unless
the task opted out by name (`task.tool_isolation=weak`).
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import signal
import sys

NOBODY = 65534
_NEWNS, _NEWUSER, _NEWPID, _NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_LOCKED = {8: _MS_NOEXEC, 1024: _MS_NOATIME, 2048: _MS_NODIRATIME, 4096: _MS_RELATIME}  # statvfs ST_* -> MS_*
_MNT_DETACH = 2
_PR_SET_PDEATHSIG, _PR_SET_SECUREBITS, _PR_SET_NO_NEW_PRIVS = 1, 28, 38
_SECBIT_NOROOT, _SECBIT_NOROOT_LOCKED = 1, 2
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_DEVICES = ("null", "zero", "random", "urandom")
FULL = ("netns", "mountns", "pidns", "unprivileged")  # what `tool_isolation=full` requires

_libc = ctypes.CDLL(None, use_errno=True)
_layers: tuple = ()


def layers() -> tuple:
    """The layers this process entered (`enter`), a subset of FULL plus "socket-guard"."""
    return _layers


def enter(scratch: str, memory_mb: int, file_mb: int, processes: int, as_nobody: bool = True,
          namespaces: bool = True) -> None:
    """Contain this (fresh, single-threaded) worker; `scratch` becomes its working directory.
    `as_nobody`: from root, become `nobody` (else, as any other user, stay this user inside a user
    namespace with every capability dropped); `namespaces=False` never asks for any."""
    global _layers
    root = os.geteuid() == 0 and as_nobody
    base = 0 if root else _tasks_of(os.getuid())  # RLIMIT_NPROC counts the user's every task
    got = []
    if namespaces and _unshare(root):
        _private_root(scratch)
        got += ["netns", "mountns", "pidns"]
    else:
        _guard_sockets()
        got.append("socket-guard")
    os.chdir(scratch)
    if _drop_privileges(root, scratch):
        got.append("unprivileged")
    _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if "pidns" in got:  # a change of credentials cleared the death signal `_fork_init` set
        _libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    _limits(memory_mb, file_mb, (processes if root else base + processes))
    _layers = tuple(got)


def reap() -> int:
    """Kill every process tool code left behind (in the PID namespace: all but this init) and
    collect them; the count collected. Without a PID namespace, this worker's children only."""
    if os.getpid() == 1:
        try:
            os.kill(-1, signal.SIGKILL)  # from a namespace's init: every other process in it
        except ProcessLookupError:
            pass
    n = 0
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if os.getpid() == 1 else os.WNOHANG)
        except ChildProcessError:
            return n
        if pid == 0:
            return n
        n += 1


def _unshare(root: bool) -> bool:
    """New network, mount and PID namespaces, this process ending as the worker: PID 1 of the
    new PID namespace (`_fork_init`). False, with nothing changed, where the kernel refuses."""
    flags = _NEWNS | _NEWPID | _NEWNET
    if root:
        if _libc.unshare(flags) != 0:
            return False
        _fork_init()
        return True
    # A user namespace needs a single-threaded caller (a worker may hold BLAS threads): fork, and
    # enter it in the child, which says over a pipe whether it could.
    uid, gid = os.geteuid(), os.getegid()
    read, write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write)
        entered = os.read(read, 1) == b"1"
        os.close(read)
        if not entered:
            os.waitpid(pid, 0)
            return False
        _shim(pid)
    os.close(read)
    _libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if _libc.unshare(flags | _NEWUSER) != 0:
        os.write(write, b"0")
        os._exit(0)
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")  # the same ids inside: files keep their owner
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    os.write(write, b"1")
    os.close(write)
    _fork_init()
    return True


def _fork_init() -> None:
    """Fork: the child is PID 1 of the new PID namespace and goes on as the worker; this process
    stays as its shim (`_shim`). When a shim is killed (the pool's handle: at a timeout or at
    close) its child gets SIGKILL (PDEATHSIG), and the kernel kills the child's whole namespace."""
    _libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    pid = os.fork()
    if pid:
        _shim(pid)
    _libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _shim(pid: int) -> None:
    """Wait for the worker `pid` and exit as it did; never returns."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _private_root(scratch: str) -> None:
    """A new root of read-only binds (`_visible`) and the writable scratch; the old one unmounted."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing done here reaches the host
    new = os.path.join(os.path.dirname(scratch), "." + os.path.basename(scratch) + "_root")
    os.makedirs(new, exist_ok=True)
    _mount("tmpfs", new, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    for path in _visible():
        _bind(path, new + path, read_only=True)
    for top in ("bin", "lib", "lib32", "lib64", "sbin"):  # /bin -> usr/bin on merged-/usr systems
        if os.path.islink("/" + top):
            os.symlink(os.readlink("/" + top), os.path.join(new, top))
    os.makedirs(new + "/dev")
    for name in _DEVICES:
        if os.path.exists("/dev/" + name):
            _bind("/dev/" + name, f"{new}/dev/{name}", read_only=False)
    _bind(scratch, new + scratch, read_only=False)
    os.chdir(new)
    if _libc.syscall(_SYS_PIVOT_ROOT.get(platform.machine(), -1), b".", b".") != 0:
        _fail("pivot_root")
    if _libc.umount2(b".", _MNT_DETACH) != 0:
        _fail("umount2")
    os.chdir("/")
    _mount(None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _visible() -> list:
    """What tool code may read: the Python installation, /usr, the dynamic linker's cache, and
    the code on `sys.path` outside them (each entry's packages and modules, not the directory:
    a workdir or a dataset beside the code stays out)."""
    import jaxrl_llm

    given = (sys.prefix, sys.base_prefix, sys.exec_prefix, "/usr")
    prefixes = {os.path.realpath(p) for p in given}
    paths = prefixes | set(given) | {os.path.dirname(os.path.realpath(jaxrl_llm.__file__))}  # a symlinked prefix too
    for entry in sys.path:
        entry = os.path.realpath(entry or os.getcwd())
        if not os.path.isdir(entry) or any(entry == p or entry.startswith(p + "/") for p in prefixes):
            continue
        for name in os.listdir(entry):
            full = os.path.join(entry, name)
            if name.endswith(".py") or os.path.isfile(os.path.join(full, "__init__.py")):
                paths.add(full)
    paths.add("/etc/ld.so.cache")
    out = []
    for p in sorted(p for p in paths if os.path.exists(p) and p != "/"):
        if not any(p.startswith(q + "/") for q in out):  # inside a bind already
            out.append(p)
    return out


def _bind(source: str, target: str, read_only: bool) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(source, target, None, _MS_BIND | _MS_REC)
    if read_only:  # a bind's flags change only on a remount; keep those the kernel locks
        f = os.statvfs(source).f_flag
        locked = sum(ms for st, ms in _LOCKED.items() if f & st)
        _mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | locked)


def _drop_privileges(root: bool, scratch: str) -> bool:
    if root:
        os.chown(scratch, NOBODY, NOBODY)
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)  # from root to another uid: every capability goes
        return True
    _libc.prctl(_PR_SET_SECUREBITS, _SECBIT_NOROOT | _SECBIT_NOROOT_LOCKED, 0, 0, 0)  # no caps back at exec
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    return _libc.capset(header, (ctypes.c_uint32 * 6)()) == 0  # those the user namespace gave


def _limits(memory_mb: int, file_mb: int, processes: int) -> None:
    if memory_mb:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    if file_mb:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _tasks_of(uid: int) -> int:
    """Tasks (threads included) running as `uid`: what RLIMIT_NPROC compares with."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return n


def _guard_sockets() -> None:
    import socket

    real = socket.socket

    class NoInternet(real):
        def __init__(self, family=-1, *args, **kwargs):
            if family in (-1, socket.AF_INET, socket.AF_INET6):
                raise PermissionError("tools have no network (sandbox)")
            super().__init__(family, *args, **kwargs)

    socket.socket = NoInternet
    socket.create_connection = lambda *a, **k: NoInternet()  # noqa: E731


def _mount(source, target, fstype, flags: int, data: str = None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        _fail(f"mount {source or ''} {target}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _fail(what: str):
    err = ctypes.get_errno()
    raise OSError(err, f"sandbox: {what}: {os.strerror(err)}")
