"""`tldr`, the paper's summarisation task, scored by a reward model (`--reward-model`) and evaluated as the
authors' eval_tldr/ does, inside the run: docs/tasks.md gives its data, its evaluation's figures and how they
compare with the authors'.
"""

import numpy as np
import torch

from loss import chunks, collate
from rewards import RewardModel
from runtime.errors import ConfigError
from tasks.task import Problem, Scorer, Task, load_splits, text_fields

HUB = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"


def problem(row: dict, where: str) -> Problem:
    text_fields(row, where, "query", "reference_response")
    return Problem(prompt=row["query"], answer=row["reference_response"])


def check(cfg) -> dict:
    if not cfg.reward_model:
        raise ConfigError("--reward-model: the tldr task is scored by a reward model: pass --reward-model (the "
                          "paper's: mnoukhov/pythia410m-rm-tldr6.9b)")
    return {}


class TldrScorer(Scorer):
    """The reward model's reward; the evaluation's judge, and a transformers copy of the policy for its
    full-vocabulary KL, kept at vLLM's weights (`loaded`). vLLM 0.32 can return whole distributions
    (SamplingParams(logprobs=-1) with LLM(max_logprobs=-1): vllm/sampling_params.py:921-926,
    vllm/config/model.py:282-286, vllm/v1/sample/sampler.py:123-127), but only for the engine's whole life
    (its search rounds too, and -1 turns off a GPU sharding of the sampler, vllm/config/vllm.py:3051-3054),
    as logprobs_mode's values (here after the evaluation's temperature 0.01, not pi_theta's), and as one
    Python {token: Logprob} dict per position: 50k entries x 128 tokens x 6.5k responses. A copy costs the
    policy's weights once more on this device and one forward per response. Only the searcher that
    evaluates builds it (`evaluates`)."""

    def __init__(self, engine, task, evaluates: bool):
        super().__init__(engine, task, evaluates)
        self.policy = engine.transformers_copy(self.cfg.model_path) if evaluates else None
        self.judge = self.sft = None  # the evaluation's judge; the initial pi_ref once TBA′ has reset it

    def loaded(self, named_tensors: list):
        if self.policy is not None:  # the evaluation's copy follows the engine's weights
            unexpected = self.policy.load_state_dict(dict(named_tensors), strict=False).unexpected_keys
            if unexpected:
                raise RuntimeError(f"weights the evaluation's policy copy does not have: {unexpected[:3]}")

    def initial_pi_ref(self):
        """The SFT model (the initial pi_ref): pi_ref itself unless TBA′ has reset it."""
        if self.engine.pi_ref_version == 0:
            return self.engine.pi_ref()
        if self.sft is None:
            self.sft = self.engine.transformers_copy(self.cfg.model_path)
        return self.sft

    def evaluate_part(self, prompts, answers):
        cfg, engine = self.cfg, self.engine
        if self.policy is None:
            raise RuntimeError("this engine was built with evaluates=False: no policy copy for the KL")
        responses, texts = engine.respond(prompts)
        rewards = self.reward(prompts, responses, texts, answers)
        if self.judge is None:
            if cfg.eval_reward_model_path == cfg.reward_model_path:
                self.judge = self.score
            else:
                with engine.beside():
                    self.judge = RewardModel(cfg.eval_reward_model_path, engine.device, cfg.dtype, engine.tokenizer,
                                             cfg.non_eos_penalty, batch=cfg.score_batch)
        eos = engine.tokenizer.eos_token_id
        references = [engine.tokenizer(a).input_ids for a in answers]
        references = [r if r[-1:] == [eos] else r + [eos] for r in references]
        # the judge reads its score where transformers' pooling does (load_and_eval.py's pipeline)
        ours = self.judge.score([p + r for p, r in zip(prompts, responses)], pooling=True)
        theirs = self.judge.score([p + r for p, r in zip(prompts, references)], pooling=True)
        kl, nll = response_kl_nll(self.policy, self.initial_pi_ref(), list(zip(prompts, responses)), cfg.score_batch,
                                  engine.device)
        length = np.array([max(1, len(r)) for r in responses])
        scores = {"score": list(rewards), "win_rate": list(np.greater(ours, theirs)),
                  "kl_ref_theta_per_token": list(kl / length), "ppl_sft": list(np.exp(nll / length)),
                  "ppl_sft_authors": list(np.exp(nll / (length + [len(p) - 1 for p in prompts])))}
        return scores, self.example(prompts, texts, rewards, "score")


@torch.no_grad()
def response_kl_nll(policy, ref, pairs, micro_batch: int, device, chunk_bytes: int = 2**28):
    """For each (prompt, response) pair: the full-vocabulary KL(ref || policy) summed over the
    distributions that predict the response's tokens, and the response's summed NLL under `ref`,
    both at temperature 1. Returns two (N,) arrays. (The authors' src/kl.py:59-71 takes the KL at the
    positions of the response's tokens, one later: from the distribution after its first token to the
    one after its last; here it is the distributions the response was drawn from.)"""
    kl_out, nll_out = [], []
    for i in range(0, len(pairs), micro_batch):
        ids, attention, response = collate(pairs[i:i + micro_batch], 0, device)  # (n, T) each
        logits = policy(input_ids=ids, attention_mask=attention).logits[:, :-1]    # (n, T-1, V): predicts t+1
        ref_logits = ref(input_ids=ids, attention_mask=attention).logits[:, :-1]   # (n, T-1, V)
        targets, mask = ids[:, 1:], response[:, 1:].float()                        # (n, T-1)
        kl, nll = torch.zeros(len(ids), device=device), torch.zeros(len(ids), device=device)  # (n,)
        for at in chunks(logits, chunk_bytes):  # float32 log-softmax a chunk of positions at a time
            logp = torch.log_softmax(logits[:, at].float(), dim=-1)                # (n, C, V)
            logp_ref = torch.log_softmax(ref_logits[:, at].float(), dim=-1)        # (n, C, V)
            kl += ((logp_ref.exp() * (logp_ref - logp)).sum(-1) * mask[:, at]).sum(1)
            nll -= (logp_ref.gather(-1, targets[:, at, None]).squeeze(-1) * mask[:, at]).sum(1)
        kl_out += kl.tolist()
        nll_out += nll.tolist()
    return np.array(kl_out), np.array(nll_out)


def memory(cfg, evaluates: bool, engines: dict, beside: dict):
    """On the searcher that evaluates: the policy copy (and its logits beside pi_ref's in the KL), the judge
    if it is not the reward model, and the SFT model once TBA′ resets pi_ref (runtime/gpu.memory_needs)."""
    from runtime import gpu
    if not evaluates:
        return
    beside["its logits"] *= 2
    beside["the evaluation's policy copy"] = beside["pi_ref"]
    if cfg.eval_reward_model_path != cfg.reward_model_path:
        beside["the judge"] = gpu.model_bytes(cfg.eval_reward_model_path, cfg.dtype, "sequence")
    if cfg.ref_reset_every:
        beside["the SFT model"] = beside["pi_ref"]


TASK = Task(load_splits(HUB, None, ("train", "validation"), problem), scorer=TldrScorer, score="win_rate",
            check=check, flags=("eval_reward_model",), memory=memory, max_prompt=512)
