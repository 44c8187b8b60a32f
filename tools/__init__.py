"""Development tools, never deployed (.funcignore): the local Functions host (devhost), the scripted
OpenAI-compatible server (fakeupstream), the benchmarks (bench) and shell scripts (scripts)."""
