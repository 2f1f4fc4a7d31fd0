"""train.py and sample.py end to end, as a user runs them: real processes, real files."""
import ast
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--arch.n_layer=1', '--arch.n_embd=32', '--arch.n_head=2', '--arch.n_kv_head=1', '--arch.intermediate_size=64', '--batch_size=4',
        '--block_size=32', '--eval_iters=2', '--log_interval=1', '--sample.tokens=0', '--warmup_steps=2']


def run(args, script='train.py', env=None):
    return subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def log(out_dir):
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        return [json.loads(line) for line in f]


CONFIGS = sorted(f for f in os.listdir(os.path.join(ROOT, 'config')) if f.endswith('.py'))


@pytest.mark.parametrize('name', CONFIGS)
def test_every_config_resolves_with_check(name, tmp_path):
    """Every config file in config/ names only settings train.py has, of their types and in
    their ranges: `train.py CONFIG --check` prints them all and exits 0, before any work: it
    writes nothing where it runs and nothing in the cache, and fetches nothing (the offline
    tasks' files a config names are made when a run starts)."""
    here, cache = tmp_path / 'cwd', tmp_path / 'cache'
    here.mkdir()
    r = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), os.path.join(ROOT, 'config', name), '--check'],
                       cwd=here, capture_output=True, text=True, timeout=300, env={**os.environ, 'NANOBITNET_CACHE': str(cache)})
    assert r.returncode == 0, r.stderr
    assert not os.listdir(here) and not cache.exists()
    settings = ast.literal_eval(r.stdout.strip().splitlines()[-1])['settings']
    scope = {}
    exec(open(os.path.join(ROOT, 'config', name)).read(), scope)
    for key, value in scope.items():  # what the file sets is what train.py would run
        if key in settings and isinstance(value, dict) and key not in ('objectives', 'mixture'):
            assert value.items() <= settings[key].items(), key
        elif key in settings:
            assert settings[key] == value, key


def test_every_sweep_file_checks_out():
    """Each sweep in sweeps/ has every arm's settings accepted as train.py takes them."""
    import arms
    for name in sorted(os.listdir(os.path.join(ROOT, 'sweeps'))):
        state = arms.new_sweep(os.path.join(ROOT, 'sweeps', name))
        assert state['arms'], name


def test_train_then_resume_carries_on_step_and_lr(tmp_path):
    out = str(tmp_path / 'out')
    r = run([*TINY, f'--out_dir={out}', '--max_steps=8', '--eval_interval=4'])
    assert r.returncode == 0, r.stderr
    straight = log(out)
    assert [rec['step'] for rec in straight] == list(range(1, 9))
    assert all('val_loss' in rec for rec in straight if rec['step'] in (4, 8))
    assert sorted(os.listdir(out))[-1] == 'log.jsonl'
    ckpts = sorted(d for d in os.listdir(out) if d.startswith('ckpt_'))
    assert ckpts[-1] == 'ckpt_0000008'
    assert {'config.json', 'model.safetensors', 'train_state.pt'} <= set(os.listdir(os.path.join(out, ckpts[-1])))

    # an interrupted run: its last checkpoint is at step 4; resume must carry on from there
    out2 = str(tmp_path / 'out2')
    assert run([*TINY, f'--out_dir={out2}', '--max_steps=8', '--eval_interval=4', '--ckpt.interval=4']).returncode == 0
    import shutil
    shutil.rmtree(os.path.join(out2, 'ckpt_0000008'))
    os.remove(os.path.join(out2, 'log.jsonl'))
    r = run([*TINY, f'--out_dir={out2}', '--max_steps=8', '--eval_interval=4', '--init_from=resume'])
    assert r.returncode == 0, r.stderr
    assert 'resumed from' in r.stdout and 'at step 4' in r.stdout
    resumed = log(out2)
    assert [rec['step'] for rec in resumed] == [5, 6, 7, 8]
    assert [rec['lr_hidden'] for rec in resumed] == [rec['lr_hidden'] for rec in straight[4:]]
    assert resumed[-1]['tokens'] == straight[-1]['tokens']


@pytest.mark.parametrize('args, message', [
    (['--batch_sise=4'], "error: unknown config key 'batch_sise'; did you mean --batch_size?"),
    (['--batch_size=big'], "error: batch_size must be int, got 'big' (str)"),
    (['--init_from=/no/such/dir'], "error: cannot load '/no/such/dir': '/no/such/dir' is neither a model directory nor a hub id"),
    (['--init_from=resume', '--out_dir=/no/such/out'], "error: no checkpoint in '/no/such/out' to resume from"),
    (['no_such_config.py'], "error: config file 'no_such_config.py' not found"),
])
def test_user_errors_are_one_line(args, message):
    r = run(args)
    assert r.returncode != 0
    assert r.stderr.strip().startswith(message), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and 'Traceback' not in r.stderr


def test_corrupt_checkpoint_is_one_line_error_and_kept(tmp_path):
    out = str(tmp_path / 'out')
    assert run([*TINY, f'--out_dir={out}', '--max_steps=2', '--eval_interval=2']).returncode == 0
    ckpt = os.path.join(out, 'ckpt_0000002')
    with open(os.path.join(ckpt, 'model.safetensors'), 'r+b') as f:
        f.truncate(100)
    r = run([*TINY, f'--out_dir={tmp_path}/new', f'--init_from={ckpt}'])
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1
    assert 'cannot read' in r.stderr and 'model.safetensors' in r.stderr and 'Traceback' not in r.stderr
    assert os.path.getsize(os.path.join(ckpt, 'model.safetensors')) == 100  # nothing was overwritten


def test_sample_falls_back_from_a_damaged_newest_checkpoint(tmp_path):
    """sample.py finds a run's checkpoint as resume does (checkpoint.find): a damaged newest
    one is skipped with one warning line, and left in place; named directly, it is a one-line
    error."""
    out = str(tmp_path / 'out')
    r = run([*TINY, f'--out_dir={out}', '--max_steps=4', '--eval_interval=4', '--ckpt.interval=2'])
    assert r.returncode == 0, r.stderr
    newest = os.path.join(out, 'ckpt_0000004')
    with open(os.path.join(newest, 'model.safetensors'), 'r+b') as f:
        f.seek(200)
        f.write(b'\xff')  # a flipped byte: same size, another sha256
    r = run([f'--ckpt={out}', '--num_tokens=4', '--prompt=Hi'], script='sample.py')
    assert r.returncode == 0, r.stderr
    assert r.stderr.count('\n') == 1 and 'ckpt_0000004' in r.stderr and 'model.safetensors' in r.stderr
    assert f"--- {os.path.join(out, 'ckpt_0000002')}:" in r.stdout
    assert os.path.isdir(newest)  # sample.py reads; it renames nothing
    r = run([f'--ckpt={newest}', '--num_tokens=4'], script='sample.py')
    assert r.returncode != 0 and r.stderr.count('\n') == 1, r.stderr
    assert r.stderr.startswith('error: cannot load') and 'model.safetensors is damaged' in r.stderr


def test_fine_tune_from_hf_dir_converts_to_bitnet_and_samples(tmp_path):
    from model import ModelConfig, Transformer
    src = str(tmp_path / 'fp')
    Transformer(ModelConfig(vocab_size=320, n_layer=1, n_embd=32, n_head=2, n_kv_head=1, intermediate_size=64,
                            max_seq_len=64, tie_embeddings=False)).save_pretrained(src)
    out = str(tmp_path / 'out')
    r = run([*TINY, f'--out_dir={out}', f'--init_from={src}', '--max_steps=2', '--eval_interval=2'])
    assert r.returncode == 0, r.stderr
    assert 'ternary model' in r.stdout
    cfg = json.load(open(os.path.join(out, 'ckpt_0000002', 'config.json')))
    assert cfg['architectures'] == ['BitNetForCausalLM'] and cfg['tie_word_embeddings'] is False
    r = run([f'--ckpt={out}', '--num_tokens=10', '--prompt=Hello'], script='sample.py')
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith('Hello') and 'tokens/s' in r.stdout


@pytest.mark.slow
def test_ddp_two_ranks_on_cpu(tmp_path):
    out = str(tmp_path / 'out')
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=2', 'train.py', *TINY,
           f'--out_dir={out}', '--max_steps=3', '--eval_interval=3', '--gradient_accumulation_steps=2']
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert 'tokens per optimizer step: 256 (2 ranks)' in r.stdout
    recs = log(out)
    assert [rec['step'] for rec in recs] == [1, 2, 3] and recs[-1]['tokens'] == 3 * 256
    assert os.path.isdir(os.path.join(out, 'ckpt_0000003'))


def test_sft_on_chat_jsonl_and_dpo_on_preference_pairs(tmp_path):
    """SFT: a chat jsonl is prepared with loss masks and trained on. DPO: a model that starts as
    its own reference has loss_dpo = ln 2 exactly at the first step, and trains from there."""
    from pydoc_data.topics import topics
    chats = [{'messages': [{'role': 'user', 'content': topics[k][:150]}, {'role': 'assistant', 'content': topics[k][150:400]}]}
             for k in sorted(topics)] * 3
    (tmp_path / 'chat.jsonl').write_text('\n'.join(json.dumps(c) for c in chats))
    sft = str(tmp_path / 'sft')
    # windows of 128 tokens: every prompt of config/preferences.jsonl (up to 69 bytes) leaves room for its answer
    r = run([*TINY, '--block_size=128', f'--out_dir={sft}', '--max_steps=2', f'--dataset={tmp_path / "chat"}', '--prepare.format=chat',
             f"--prepare.files={{'train': '{tmp_path / 'chat.jsonl'}'}}", '--bitnet=False'])
    assert r.returncode == 0, r.stderr
    assert 'prepared' in r.stdout and all(math.isfinite(rec['loss']) for rec in log(sft))

    dpo = str(tmp_path / 'dpo')
    r = run([*TINY, '--block_size=128', 'config/dpo.py', f'--out_dir={dpo}', f'--init_from={sft}', f'--teacher={sft}', '--bitnet=False',
             '--max_steps=3', '--eval_interval=3'])
    assert r.returncode == 0, r.stderr
    recs = log(dpo)
    assert abs(recs[0]['loss_dpo'] - math.log(2)) < 1e-6 and recs[0]['w_dpo'] == 1.0
    assert all(math.isfinite(rec['loss_dpo']) for rec in recs)


def test_bad_data_settings_fail_in_one_line(tmp_path):
    r = run([*TINY, f'--out_dir={tmp_path}', '--remix.interval=5'])
    assert r.returncode != 0 and r.stderr.strip().count('\n') == 0 and 'mixture' in r.stderr
    r = run([*TINY, f'--out_dir={tmp_path}', f'--dataset={tmp_path / "none"}'])
    assert r.returncode != 0 and r.stderr.strip().count('\n') == 0 and 'shards' in r.stderr


def test_every_eval_logs_the_greedy_continuations_of_eval_prompts(tmp_path):
    from engine import generate
    from model import Transformer
    from tokenizer import get_tokenizer
    out = str(tmp_path / 'out')
    r = run([*TINY, f'--out_dir={out}', '--max_steps=4', '--eval_interval=2', "--sample.prompts=['def ', 'The ']"])
    assert r.returncode == 0, r.stderr
    recs = log(out)
    assert [rec['step'] for rec in recs if 'samples' in rec] == [2, 4]  # eval steps only
    # the last one is what the saved model writes greedily, up to its 32 trained positions
    model, enc = Transformer.from_pretrained(os.path.join(out, 'ckpt_0000004')).eval(), get_tokenizer('bytes')
    for prompt, sample in zip(('def ', 'The '), recs[-1]['samples']):
        x = torch.tensor([enc.encode_ordinary(prompt)])
        y = generate(model, x, 32 - x.size(1), temperature=0, vocab=enc.n_vocab)[0, x.size(1):]
        assert sample == enc.decode(y.tolist()) and len(y) == 28


def test_sft_val_loss_counts_only_answers_when_some_val_batches_hold_none(tmp_path):
    """Long prompts, short answers, small windows: some val batches hold no answer token. The val loss is
    the mean over the counted targets of all val batches, never 0/0 (which made it NaN and stopped runs);
    val data with no answer at all is a one-line error."""
    from pydoc_data.topics import topics
    keys = sorted(topics)
    train = [{'prompt': topics[k][:300], 'response': topics[k][300:340]} for k in keys]
    val = [{'prompt': topics[k][:600], 'response': 'yes'} for k in keys[:2]]
    val += [{'prompt': k, 'response': topics[k][:100]} for k in keys[2:4]]
    prompts = [{'messages': [{'role': 'user', 'content': topics[k][:600]}]} for k in keys[:4]]  # no answer
    for name, rows in (('train', train), ('val', val), ('prompts', prompts)):
        (tmp_path / f'{name}.jsonl').write_text('\n'.join(json.dumps(c) for c in rows))
    args = [*TINY, '--max_steps=2', '--eval_interval=1', '--eval_iters=8', '--prepare.format=chat']
    out = str(tmp_path / 'out')
    r = run([*args, f'--out_dir={out}', f'--dataset={tmp_path / "a"}',
             f"--prepare.files={{'train': '{tmp_path / 'train.jsonl'}', 'val': '{tmp_path / 'val.jsonl'}'}}"])
    assert r.returncode == 0, r.stderr
    vals = [rec['val_loss'] for rec in log(out) if 'val_loss' in rec]
    assert len(vals) == 2 and all(math.isfinite(v) and v > 0 for v in vals)
    r = run([*args, f'--out_dir={tmp_path / "b"}', f'--dataset={tmp_path / "b"}',
             f"--prepare.files={{'train': '{tmp_path / 'train.jsonl'}', 'val': '{tmp_path / 'prompts.jsonl'}'}}"])
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith('error: no val batch holds a counted')


def test_tokenizer_of_a_runs_folder_is_its_newest_checkpoints(tmp_path):
    """A run's folder as tokenizer= names the tokenizer its newest checkpoint was trained
    with, here the byte tokenizer, which has no file."""
    first = tmp_path / 'first'
    r = run([*TINY, f'--out_dir={first}', '--max_steps=1', '--tokenizer=bytes'])
    assert r.returncode == 0, r.stderr
    r = run([*TINY, f'--out_dir={tmp_path / "second"}', '--max_steps=1', f'--tokenizer={first}'])
    assert r.returncode == 0, r.stderr
    state = torch.load(tmp_path / 'second' / 'ckpt_0000001' / 'train_state.pt', weights_only=True)
    assert state['tokenizer'] == 'bytes'


def test_init_from_a_directory_trains_with_its_own_tokenizer(tmp_path):
    """A model directory that ships a tokenizer.json is trained (and sampled) with it unless told
    otherwise; another tokenizer that encodes differently is an error, not a silent mismatch."""
    pytest.importorskip('tokenizers')
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from model import ModelConfig, Transformer
    src, out = tmp_path / 'fp', str(tmp_path / 'out')
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([topics[k] for k in sorted(topics)[:20]], trainers.BpeTrainer(
        vocab_size=400, special_tokens=['<|endoftext|>'], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    Transformer(ModelConfig(vocab_size=448, n_layer=1, n_embd=32, n_head=2, n_kv_head=1, intermediate_size=64,
                            max_seq_len=64)).save_pretrained(str(src))
    tok.save(str(src / 'tokenizer.json'))
    r = run([*TINY, f'--out_dir={out}', f'--init_from={src}', '--max_steps=2', '--eval_interval=2'])
    assert r.returncode == 0, r.stderr
    ckpt = os.path.join(out, 'ckpt_0000002')
    assert torch.load(os.path.join(ckpt, 'train_state.pt'), weights_only=True)['tokenizer'] == str(src)
    assert open(os.path.join(ckpt, 'tokenizer.json')).read() == (src / 'tokenizer.json').read_text()
    r = run([f'--ckpt={ckpt}', '--num_tokens=3', '--prompt=The with statement', '--temperature=0'], script='sample.py')
    assert r.returncode == 0 and r.stdout.startswith('The with statement'), r.stderr
    r = run([*TINY, f'--out_dir={tmp_path / "b"}', f'--init_from={src}', '--max_steps=2', '--tokenizer=bytes'])
    assert r.returncode != 0 and r.stderr.strip().count('\n') == 0
    assert "tokenizer 'bytes' does not encode as the model's own" in r.stderr


def test_a_new_phase_starts_the_optimizer_moments_afresh_in_a_straight_and_a_resumed_run(tmp_path):
    """CE, then CE + masked diffusion from step 3 of 6: AdamW's step count restarts there (3 steps
    taken since, not 6) and the LR warms up again over warmup_steps (2), the same in a run resumed at
    step 2 as in a straight one; phase_reset=False carries the moments and the LR on, and so trains
    differently after the switch."""
    phases = ["--objectives={'ce': {}, 'diffusion': {}}",
              "--curriculum=[(0.5, {'ce': 1.0}), (1.0, {'ce': 1.0, 'diffusion': 1.0})]"]
    args = [*TINY, *phases, '--max_steps=6', '--eval_interval=6']

    def adam_steps(out):
        state = torch.load(os.path.join(out, 'ckpt_0000006', 'train_state.pt'), weights_only=False)
        return {int(s['step']) for opt in state['optimizers'] for s in opt['state'].values()}
    straight, chunked, carried = (str(tmp_path / name) for name in ('straight', 'chunked', 'carried'))
    assert run([*args, f'--out_dir={straight}']).returncode == 0
    assert run([*args, f'--out_dir={chunked}', '--stop_after=2']).returncode == 0
    r = run([*args, f'--out_dir={chunked}', '--init_from=resume'])
    assert r.returncode == 0, r.stderr
    assert run([*args, f'--out_dir={carried}', '--phase_reset=False']).returncode == 0
    assert adam_steps(straight) == adam_steps(chunked) == {3} and adam_steps(carried) == {6}
    recs = {out: log(out) for out in (straight, chunked, carried)}
    assert [r['loss'] for r in recs[straight]] == [r['loss'] for r in recs[chunked]]
    losses = {out: [r['loss'] for r in recs[out]] for out in recs}
    assert losses[carried][:4] == losses[straight][:4] and losses[carried][4:] != losses[straight][4:]
    ratios = [a['lr_hidden'] / b['lr_hidden'] for a, b in zip(recs[straight], recs[carried])]
    assert ratios == [1, 1, 1, 0.5, 1, 1]


def auto_batch_runs(args, out):
    """A run at batch_size 8 x 1 with auto_batch under a limit of 40% of what 8 sequences keep
    for backward, and the run at the micro-batch it chose without auto_batch: (chosen, their
    logs)."""
    r = run([*args, f'--out_dir={out}/probe', '--max_steps=1', '--auto_batch.on=True', '--auto_batch.gib=1000'])
    assert r.returncode == 0 and 'auto_batch: batch_size=8 x 1' in r.stdout, r.stderr
    whole = float(r.stdout.split('auto_batch: ')[1].split('(')[1].split(' GiB')[0])
    r = run([*args, f'--out_dir={out}/auto', '--auto_batch.on=True', f'--auto_batch.gib={0.4 * whole}'])
    assert r.returncode == 0, r.stderr
    chosen = int(r.stdout.split('auto_batch: batch_size=')[1].split(' ')[0])
    assert chosen < 8 and f'batch_size={chosen} x {8 // chosen} ' in r.stdout
    r = run([*args, f'--out_dir={out}/plain', f'--batch_size={chosen}', f'--gradient_accumulation_steps={8 // chosen}'])
    assert r.returncode == 0, r.stderr
    return chosen, log(f'{out}/auto'), log(f'{out}/plain')


def test_auto_batch_under_a_memory_limit_splits_a_dpo_step_and_keeps_its_losses(tmp_path):
    """auto_batch_gib bounds what a micro-step keeps for backward on any device: here DPO (CE +
    DPO on preference pairs, the model its own reference) gets a smaller micro-batch and more
    accumulation steps, and the same losses as the run set to that split by hand."""
    from model import ModelConfig, Transformer
    base = str(tmp_path / 'base')
    Transformer(ModelConfig(vocab_size=320, n_layer=1, n_embd=32, n_head=2, n_kv_head=1, intermediate_size=64,
                            max_seq_len=128)).save_pretrained(base)
    args = [*TINY, 'config/dpo.py', '--block_size=128', f'--init_from={base}', f'--teacher={base}', '--bitnet=False',
            '--batch_size=8', '--gradient_accumulation_steps=1', '--max_steps=3', '--eval_interval=3']
    chosen, auto, plain = auto_batch_runs(args, tmp_path)
    assert len(auto) == len(plain) == 3
    for a, b in zip(auto, plain):
        assert a['loss'] == b['loss'] and a['loss_dpo'] == b['loss_dpo'], (a, b)
    assert auto[-1]['val_loss'] == plain[-1]['val_loss']


def test_check_prints_the_resolved_settings_and_starts_nothing(tmp_path):
    """--check: the settings as a run would take them (config file, then --key=value) and their
    ranges, printed as one Python literal; no folder made, no model built. A bad one is one line."""
    import ast
    out = tmp_path / 'never'
    r = run(['--check', 'config/tiny_fp.py', '--max_steps=7', f'--out_dir={out}'])
    assert r.returncode == 0, r.stderr
    printed = ast.literal_eval(r.stdout.strip())
    assert printed['settings']['bitnet'] is False and printed['settings']['max_steps'] == 7
    assert printed['ranges']['max_steps'] == 'positive' and not out.exists()
    r = run(['--check', '--max_steps=0'])
    assert r.returncode == 1 and r.stderr.strip().count('\n') == 0 and 'max_steps' in r.stderr


def renamed_table():
    """train.py's RENAMED, read from its source (importing train.py would run it)."""
    tree = ast.parse(open(os.path.join(ROOT, 'train.py')).read())
    found = [node.value for node in tree.body if isinstance(node, ast.Assign)
             and [t.id for t in node.targets if isinstance(t, ast.Name)] == ['RENAMED']]
    return ast.literal_eval(found[0])


def test_every_renamed_setting_fails_in_one_line_with_its_new_spelling(tmp_path):
    """Each flat name that the grouping of settings replaced, on the command line, in a config file
    and as a group (--rollout.group), exits 1 in one line naming its new spelling, which is a setting
    train.py has."""
    from configurator import configure
    renamed = renamed_table()
    assert len(renamed) == 36 and renamed['ckpt_interval'] == 'ckpt.interval'
    r = run(['--check'])
    settings, ranges = (ast.literal_eval(r.stdout.strip())[k] for k in ('settings', 'ranges'))
    for old, new in renamed.items():
        group, _, key = new.partition('.')
        assert old not in settings and (key in settings[group] if key else group in settings), new
        for arg in [f'--{old}=1', f'--{old}.x=1']:
            with pytest.raises(SystemExit, match=rf"^error: '{old}' is now '{re.escape(new)}': set --{re.escape(new)}=VALUE"):
                configure(dict(settings), [arg], ranges, renamed)
        config = tmp_path / f'{old}.py'
        config.write_text(f'{old} = 1\n')
        with pytest.raises(SystemExit, match=rf"is now '{re.escape(new)}'"):
            configure(dict(settings), [str(config)], ranges, renamed)
    r = run(['--ckpt_interval=8', '--max_steps=1', f'--out_dir={tmp_path / "never"}'])
    assert r.returncode == 1 and r.stderr == "error: 'ckpt_interval' is now 'ckpt.interval': set --ckpt.interval=VALUE instead of --ckpt_interval\n"
    assert not (tmp_path / 'never').exists()
