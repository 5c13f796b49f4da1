"""The run's random streams. Every random draw derives from --seed and a tag naming what it is for
(np.random.default_rng([seed, ..., TAG]) or a vLLM request's seed from the same list), so that a run is
reproducible from its seed and no two uses of randomness draw the same numbers. The values are
arbitrary but fixed: changing one changes every run's samples.
"""

SEARCH_PROMPTS = 1  # a searcher's choice of prompts for each round (searcher.run)
BATCH = 2           # the trainer's draw of a batch from the buffer, each step (tba.Trainer.sample)
SYNC_PROMPTS = 3    # --searchers 0: the prompts of each search round (runtime.local.LocalFleet.collect)
EVAL_ATTACKS = 5    # the red-teaming evaluation's attacks (tasks/redteam.py, its scorer's evaluate)
VICTIM = 7          # the victim's answers to each batch of attacks (redteam.Reward)
CALIBRATION = 13    # --generation-slowdown's calibration round: its prompts and sampling (runtime.slowdown.calibrate)
EXPLORE = 11        # --explore-temp-min: each request's temperature, after its seed and prompt (searcher.Engine.explore)
EVALUATION = 17     # --eval-temperature above 0: each held-out problem's sampling, after its prompt (searcher.Engine.respond)
TAILS = 19          # --response-lengths gsm8k: each response's emulated length, after its seed (runtime.slowdown.tail)
