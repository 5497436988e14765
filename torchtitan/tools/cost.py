"""What a piece of work cost: its wall time and the CPU time of the thread that ran it. On a host with more busy
threads than cores (or in a collective that waits for slower processes) the wall time also counts the waiting; the
thread's CPU time is the work alone, which is what shows whether the work itself grew."""

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Cost:
    wall_s: float
    cpu_s: float

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.wall_s + other.wall_s, self.cpu_s + other.cpu_s)


class Stopwatch:
    """Started when made; `cost()` is what the calling thread spent since."""

    def __init__(self) -> None:
        self._wall = time.perf_counter()
        self._cpu = time.thread_time()

    def cost(self) -> Cost:
        return Cost(time.perf_counter() - self._wall, time.thread_time() - self._cpu)
