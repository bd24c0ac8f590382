"""track_1_short: a GPT-2-small training speedrun trainer whose training step runs as CUDA graphs.

Nothing here runs at import time (no process group, no device work, no dynamo config changes);
`track_1_short.train.main()` is the entry point. See README.md for the file map.
"""
