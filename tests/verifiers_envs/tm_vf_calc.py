"""A multi-turn verifiers v1 environment with a tool: the model calls `calc_add` (an MCP tool server the
environment runs), reads the result and answers (tests). Run as a module, it serves the tool."""

import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class CalcData(vf.TaskData):
    answer: str


class CalcTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalcTask(vf.Task[CalcData, vf.State, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    @vf.reward
    async def correct(self, task, trace) -> float:
        return 1.0 if trace.last_reply.strip() == task.answer else 0.0


class CalcConfig(vf.TasksetConfig):
    task: CalcTaskConfig = CalcTaskConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self):
        yield CalcTask(CalcData(prompt="2+3=", answer="5"), self.config.task)


__all__ = ["CalcTaskset"]

if __name__ == "__main__":
    CalcToolset.run()
