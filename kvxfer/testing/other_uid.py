"""Another uid on this host, for the tests that attack as one (root only).

One home for kvxfer's own tests and the in-tree plugins' (the store's trust tests, the UCX
security tests): the unprivileged user ``kvxfer-attacker``, created once and idempotently; :func:`as_user` runs a small function
in a forked child that has dropped to it for good, so what the child makes on disk really
belongs to that uid.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from typing import Callable

import pytest

ATTACKER_USER = "kvxfer-attacker"


def attacker() -> pwd.struct_passwd:
    """The attacker user (created if absent); skips the test unless running as root."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the test creates an unprivileged user and acts as it (CI runs as root)")
    try:
        return pwd.getpwnam(ATTACKER_USER)
    except KeyError:
        useradd = shutil.which("useradd")
        if useradd is None:
            pytest.skip("needs useradd to create the unprivileged attacker user")
        subprocess.run([useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", ATTACKER_USER],
                       check=False, capture_output=True)
        return pwd.getpwnam(ATTACKER_USER)  # raises if it still does not exist


def as_user(pw: pwd.struct_passwd, fn: Callable[[], None]) -> None:
    """Run ``fn`` in a forked child that is ``pw`` (groups, gid, uid); raise if it failed.
    ``fn`` should only make system calls (the child of a threaded parent)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            if os.geteuid() == pw.pw_uid and os.getuid() == pw.pw_uid:
                fn()
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child acting as {pw.pw_name} failed"
