"""The process that puts a program in its jail, then becomes (or starts) it.

Run by `local.py` as `python -I -S _jail.py SETTINGS_JSON` (a fresh
interpreter: no threads of the run, no site-packages, nothing but the
standard library), with the program's stdin/stdout/stderr already wired and
a status pipe on the fd named in the settings. It never imports arl_jax.

With `isolate` (Linux, root or unprivileged user namespaces):

1. `unshare` new mount, network, PID, IPC and UTS namespaces (and a user
   namespace mapping the caller's uid to root when not run as root): the
   program sees no network interface but a down loopback, no process of the
   run, and mounts of its own.
2. Home directories are covered by empty tmpfs mounts (the interpreter's
   own directories bound back where they lie under one), every mount
   becomes read-only (`mount_setattr(AT_RECURSIVE)`), then fresh
   size-capped tmpfs mounts cover /tmp, /var/tmp and /dev/shm, and the
   program's working directory is bound read-write at /tmp/work. Writes
   anywhere else fail; /tmp writes land in a tmpfs that dies with the jail.
3. It forks: the child is PID 1 of the new PID namespace, mounts its own
   /proc, sets no-new-privileges, drops to an unprivileged uid (when the
   jail ran as root) or, as root of its own user namespace, drops every
   capability and the bounding set (so it cannot unmount what hides the
   caller's home), applies the resource limits, asks for SIGKILL when the jail dies, and
   execs the program. The jail waits and exits with the program's status
   (128 + signal when a signal ended it). Killing the jail kills PID 1, and
   the kernel then kills every process in the namespace: a fork bomb or a
   process that left the process group dies with it.

Without `isolate` it applies the limits (and drops to the unprivileged uid
when run as root) and execs the program itself: no network or file
isolation, which `local.py` reports and runs only on opt-in.

Setup errors are written as one JSON line to the status fd and end the jail
with exit code 121; the fd is close-on-exec, so the caller reads EOF and
nothing else when the program started.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY = 1
SYS_MOUNT_SETATTR = 442  # the same number on x86_64 and arm64
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
CAPABILITY_VERSION_3 = 0x20080522
SETUP_FAILED = 121

_libc = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):
  _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
              ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


class SetupError(Exception):
  pass


def _check(result, what):
  if result != 0:
    errno = ctypes.get_errno()
    raise SetupError(f"{what}: {os.strerror(errno)} (errno {errno})")


def _mount(source, target, fstype, flags, data=None):
  _check(_libc.mount(source.encode() if source else None, target.encode(),
                     fstype.encode() if fstype else None, ctypes.c_ulong(flags),
                     data.encode() if data else None), f"mount {fstype or source} on {target}")


def _mount_setattr(path, *, set_flags=0, clear_flags=0, propagation=0, recursive=False):
  attr = _MountAttr(set_flags, clear_flags, propagation, 0)
  _check(_libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(),
                       AT_RECURSIVE if recursive else 0, ctypes.byref(attr),
                       ctypes.sizeof(attr)), f"mount_setattr {path}")


def _write(path, text):
  with open(path, "w") as f:
    f.write(text)


def _enter_namespaces(settings):
  uid, gid = os.getuid(), os.getgid()
  flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
  if uid != 0:
    flags |= CLONE_NEWUSER
  _check(_libc.unshare(flags), "unshare")
  if uid != 0:  # root inside, the caller outside: enough to mount, nothing more
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"0 {uid} 1")
    _write("/proc/self/gid_map", f"0 {gid} 1")
  _mount(None, "/", None, MS_REC | MS_PRIVATE)
  work = os.open(settings["workdir"], os.O_RDONLY | os.O_DIRECTORY)
  # Home directories (keys, tokens, the run's files) are covered by empty
  # tmpfs; what the interpreter needs from under them is bound back.
  exposed = [(path, os.open(path, os.O_RDONLY | os.O_DIRECTORY))
             for path in settings["expose"] if os.path.isdir(path)]
  hidden = [path for path in settings["hide"] if os.path.isdir(path)]
  for path in hidden:
    _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
  for path, fd in exposed:
    if any(path == h or path.startswith(h.rstrip("/") + "/") for h in hidden):
      os.makedirs(path, exist_ok=True)
      _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
    os.close(fd)
  _mount_setattr("/", set_flags=MOUNT_ATTR_RDONLY, recursive=True)
  tmpfs = f"size={settings['tmpfs_bytes']},mode=1777"
  for path in ("/tmp", "/var/tmp", "/dev/shm"):
    if os.path.isdir(path):
      _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, tmpfs)
  os.mkdir("/tmp/work")
  _mount(f"/proc/self/fd/{work}", "/tmp/work", None, MS_BIND)
  _mount_setattr("/tmp/work", clear_flags=MOUNT_ATTR_RDONLY)
  os.close(work)
  os.chdir("/tmp/work")


def _limit(settings):
  def both(kind, value):
    resource.setrlimit(kind, (value, value))

  cpu = settings["cpu_s"]
  # The soft limit sends SIGXCPU; the hard one, a second later, SIGKILL.
  resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
  both(resource.RLIMIT_AS, settings["memory_bytes"])
  both(resource.RLIMIT_FSIZE, settings["file_bytes"])
  both(resource.RLIMIT_NPROC, settings["nproc"])
  both(resource.RLIMIT_NOFILE, settings["nofile"])
  both(resource.RLIMIT_CORE, 0)


class _CapHeader(ctypes.Structure):
  _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
  _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
              ("inheritable", ctypes.c_uint32)]


def _drop_privileges(settings):
  # No set-uid program or file capability can raise what follows.
  _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
  if os.getuid() == 0 and settings["uid"] is not None:
    # Root is exempt from RLIMIT_NPROC and may write anywhere: never run as root.
    os.setgroups([])
    os.setgid(settings["uid"])
    os.setuid(settings["uid"])
  elif os.getuid() == 0:
    # Root of its own user namespace (an unprivileged caller's jail): it
    # could unmount what hides the caller's home. Every capability goes,
    # the bounding set too, so the program's exec gets none back.
    for cap in range(64):
      if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
        break  # (past the kernel's last capability)
    header = _CapHeader(CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")


def _exec(settings):
  env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.getcwd(), "LANG": "C.UTF-8",
         "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
  argv = settings["argv"]
  os.execve(argv[0], argv, env)


def _program_child(settings, status_fd):
  """PID 1 of the new namespace: the program, once it is limited."""
  try:
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _drop_privileges(settings)
    _limit(settings)
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    _exec(settings)
  except BaseException as e:  # noqa: BLE001 - reported on the status fd
    _fail(status_fd, f"{type(e).__name__}: {e}")


def _fail(status_fd, reason):
  try:
    os.write(status_fd, (json.dumps({"setup_failed": reason}) + "\n").encode())
  finally:
    os._exit(SETUP_FAILED)


def main():
  settings = json.loads(sys.argv[1])
  status_fd = settings["status_fd"]
  os.set_inheritable(status_fd, False)  # closed by the program's exec
  try:
    if not settings["isolate"]:
      os.chdir(settings["workdir"])
      _drop_privileges(settings)
      _limit(settings)
      _exec(settings)
    _enter_namespaces(settings)
  except BaseException as e:  # noqa: BLE001 - reported on the status fd
    _fail(status_fd, f"{type(e).__name__}: {e}")
  pid = os.fork()
  if pid == 0:
    _program_child(settings, status_fd)
  os.close(status_fd)
  _, status = os.waitpid(pid, 0)
  if os.WIFSIGNALED(status):
    os._exit(128 + os.WTERMSIG(status))
  os._exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
  main()
