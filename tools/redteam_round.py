"""Times one red-teaming search round by part: the attacker's generation (vLLM), the victim's answers
and the classifier (redteam.py), with the models and settings of a tba.py run. Three rounds, the first a
warm-up. docs/tasks.md ("A round, before and after") gives its results on the tiny models.

    python tools/redteam_round.py --task redteam --model ATTACKER --victim V --classifier C \
        --embedding-model E [tba.py flags]
"""

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root, above tools/
sys.path.insert(0, ROOT)  # for config, searcher, ... when run as `python tools/redteam_round.py`

from runtime import vllm_env  # noqa: E402

vllm_env.set_up()  # before torch and vLLM are imported: they read it at import

import torch  # noqa: E402

from runtime import checks  # noqa: E402
from runtime.decoding import sampling_params  # noqa: E402
from runtime.config import Config  # noqa: E402
from runtime.errors import ConfigError  # noqa: E402
from searcher import Engine  # noqa: E402
from runtime.vllm_env import quiet_loading  # noqa: E402


def main(argv=None):
    cfg = checks.parse(Config, sys.argv[1:] if argv is None else argv)
    quiet_loading()
    try:
        cfg, data, _ = checks.check(cfg, 1)
    except ConfigError as e:
        sys.exit(f"redteam_round.py: error: {e}")
    torch.set_num_threads(cfg.threads * (1 + cfg.searchers))  # one process here: all the cores
    t0 = time.time()
    memory = cfg.searcher_memory if cfg.searchers else cfg.trainer_memory  # the GPU's share runtime.checks split
    engine = Engine(cfg, "cpu" if cfg.device == "cpu" else "cuda:0", memory, data.prompts, data.answers)
    attacks = cfg.prompts_per_step * cfg.search_samples_per_prompt
    print(f"{len(engine.llms)} vLLM engines started in {time.time() - t0:.1f} s; one search round: {attacks} attacks "
          f"x {cfg.victim_responses} victim responses; victim sampling {engine.scorer.score.victim.sampling}; "
          f"{torch.get_num_threads()} threads")
    for round_ in range(3):  # the first round warms up
        t0 = time.time()
        params = sampling_params(cfg.temperature, cfg.max_new_tokens, (round_,), n=attacks, logprobs=None)
        out = engine.llm.generate([{"prompt_token_ids": data.prompts[0]}], params, use_tqdm=False)[0].outputs
        generation = time.time() - t0
        engine.scorer.reward([data.prompts[0]] * len(out), [c.token_ids for c in out], [c.text for c in out], None)
        s, tokens, victim_tokens = engine.scorer.seconds, sum(len(c.token_ids) for c in out), engine.scorer.score.victim.tokens
        print(f"round {round_}: attacker generation {generation:.2f} s ({tokens} tokens, {tokens / generation:.0f}/s) | "
              f"victim {s['victim']:.2f} s ({victim_tokens} tokens, {victim_tokens / s['victim']:.0f}/s; "
              f"{s['victim'] / generation:.1f}x the attacker's time) | classifier {s['classifier']:.2f} s"
              + (" (warm-up)" if round_ == 0 else ""))
    engine.close()


if __name__ == "__main__":
    main()
