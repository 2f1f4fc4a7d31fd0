# A config file for the GRPO runs of the tests (passed first on the command line): a reward that
# tells apart the completions of an untrained model, so that advantages are not all 0, added the
# way a user adds one. The prompts are a file the test writes.
import rl


def _vowels(prompts, completions, **columns):
    return [sum(ch in 'aeiou' for ch in c) / max(len(c), 1) for c in completions]


rl.REWARDS['vowels'] = _vowels
objectives = {'grpo': {}}
curriculum = [(1.0, {'grpo': 1.0})]
grpo = dict(group=4, max_new_tokens=12, temperature=1.0, top_p=1.0, rewards=['vowels'],
            scale_rewards='group')
block_size = 64
batch_size = 2
