"""The reward-model reward (rewards.RewardModel): the searcher's scores equal a direct transformers
forward of the same classifier on the same cut text, and the non-EOS penalty applies only when asked."""

import pytest
import torch

from rewards import RewardModel


def direct(path, sequences):
    """transformers' own forward, one unpadded sequence at a time (its pooling reads the last token)."""
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([s])).logits[0, 0].item() for s in sequences]


@pytest.mark.parametrize("arch", ["gpt_neox", "llama"])
def test_reward_model_scores_the_cut_response(arch, tmp_path):
    import models
    from transformers import AutoTokenizer
    tok = models.make_bpe_tokenizer()
    path = str(tmp_path / "rm")
    models.make_reward_model(path, arch=arch, tokenizer=tok)
    policy_tok = AutoTokenizer.from_pretrained(path)
    eos = policy_tok.eos_token_id
    prompts = [tok("SUBREDDIT: r/jobs\n\nPOST: my boss wants weekends\n\nTL;DR:").input_ids, tok("47+85=").input_ids]
    responses = [tok(" boss wants weekends").input_ids + [eos] + tok(" and more").input_ids,  # cut after EOS
                 tok("132").input_ids]                                                        # no EOS
    for penalty in (False, True):
        rm = RewardModel(path, "cpu", "float32", policy_tok, non_eos_penalty=penalty, batch=2)
        scores = rm(prompts, responses)
        cut = [prompts[0] + responses[0][:responses[0].index(eos) + 1], prompts[1] + responses[1]]
        expected = direct(path, cut)
        assert scores[0] == pytest.approx(expected[0], abs=1e-5)  # padded batch == one unpadded forward
        assert scores[1] == (-1.0 if penalty else pytest.approx(expected[1], abs=1e-5))
        assert abs(expected[0] - expected[1]) > 1e-4  # the two sequences score differently: a real check


def test_reward_model_with_another_vocabulary_scores_the_text(tiny_model, tmp_path):
    """A policy with a character tokenizer, a reward model with a BPE one: the text is tokenized again."""
    import models
    from transformers import AutoTokenizer
    path = str(tmp_path / "rm")
    _, rm_tok = models.make_reward_model(path, arch="gpt_neox")
    policy_tok = AutoTokenizer.from_pretrained(tiny_model)
    rm = RewardModel(path, "cpu", "float32", policy_tok, non_eos_penalty=False)
    assert not rm.same_vocab
    prompt, response = policy_tok("12+34=").input_ids, policy_tok("46").input_ids + [policy_tok.eos_token_id]
    (score,) = rm([prompt], [response])
    assert score == pytest.approx(direct(path, [rm_tok("12+34=46").input_ids + [rm_tok.eos_token_id]])[0], abs=1e-5)
