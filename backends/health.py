"""The health check hook: an operator-supplied command, run with the node name, exit 0 = healthy."""

from __future__ import annotations

import asyncio


class HealthCheck:
    def __init__(self, argv: list[str], timeout: float = 60.0):
        self._argv = argv
        self._timeout = timeout

    async def check(self, node: str) -> tuple[bool, str]:
        if not self._argv:
            return True, "in service in Slurm (no health check hook configured)"
        argv = [arg.replace("{node}", node) for arg in self._argv]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self._timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            return False, f"health check timed out after {self._timeout:.0f} s"
        text = out.decode(errors="replace").strip()[-500:]
        if proc.returncode == 0:
            return True, f"health check passed: {text}" if text else "health check passed"
        return False, f"health check exited {proc.returncode}: {text}"
