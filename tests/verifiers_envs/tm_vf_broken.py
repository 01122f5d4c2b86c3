"""Verifiers v1 environments that fail (tests): one whose taskset cannot load its rows, one whose reward raises
during the rollout (`taskset.fail_loading: false`)."""


import verifiers.v1 as vf


class BrokenTask(vf.Task[vf.TaskData]):
    @vf.reward
    async def exploding(self, trace) -> float:
        raise RuntimeError("the judge is out to lunch")


class BrokenConfig(vf.TasksetConfig):
    fail_loading: bool = True


class BrokenTaskset(vf.Taskset[BrokenTask, BrokenConfig]):
    def load(self):
        if self.config.fail_loading:
            raise FileNotFoundError("rows.parquet: no such split 'train'")
        yield BrokenTask(vf.TaskData(prompt="1+1="), self.config.task)


__all__ = ["BrokenTaskset"]
