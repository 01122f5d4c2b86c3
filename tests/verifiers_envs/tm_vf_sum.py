"""A single-turn verifiers v1 environment with a rubric of two weighted rewards and a metric (tests)."""

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def exact(self, task, trace) -> float:
        return 1.0 if trace.last_reply.strip() == task.answer else 0.0

    @vf.reward(weight=0.5)
    async def has_digit(self, trace) -> float:
        return 1.0 if any(c.isdigit() for c in trace.last_reply) else 0.0

    @vf.metric
    async def reply_chars(self, trace) -> float:
        return float(len(trace.last_reply))


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 6


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        for a in range(self.config.num_tasks):
            yield SumTask(SumData(prompt=f"{a}+{a + 1}=", answer=str(2 * a + 1)), self.config.task)


__all__ = ["SumTaskset"]
