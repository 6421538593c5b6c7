#!/usr/bin/env python3
"""Tiny SentencePiece tokenizers for the GGUF tests, made with the real tooling: a 400-piece
BPE `tokenizer.model` trained by `sentencepiece` (byte fallback, identity normalisation, as
Llama 2 and Gemma ship theirs), `tokenizer.json` converted from it by transformers'
`AutoTokenizer` (what `save_pretrained` writes), and `tokenizer_config.json` laid out as the
released checkpoints' are (`added_tokens_decoder` included, which transformers 5 no longer
writes).

    tests/fixtures/gguf/spm-llama2/   <unk>=0 <s>=1 </s>=2, as meta-llama/Llama-2-7b-hf
    tests/fixtures/gguf/spm-gemma/    <pad>=0 <eos>=1 <bos>=2 <unk>=3 <mask>=4 (control),
                                      <start_of_turn>/<end_of_turn>/<unused0>/▁▁ user-defined,
                                      as google/gemma-2-2b (one added token not special)
    tests/fixtures/gguf/spm-phi3/     spm-llama2's tokenizer.model with Phi-3's added tokens
                                      after the 400 pieces (<|endoftext|>=400 … <|user|>=406,
                                      <|placeholder1|> not special) in tokenizer.json,
                                      tokenizer_config.json and added_tokens.json (plus one id
                                      past the vocabulary there, which the converter skips), as
                                      microsoft/Phi-3-mini-4k-instruct

Usage: gen-spm-fixtures.py [NAME...]   (needs sentencepiece, transformers; run from the
repository root; names: spm-llama2 spm-gemma spm-phi3, default all; spm-phi3 reads spm-llama2)"""
import codecs, collections, argparse, json, os, re, shutil, sys, tempfile, this

import sentencepiece as spm
from transformers import AutoTokenizer

OUT = os.path.join("tests", "fixtures", "gguf")
TEXT = "\n".join([codecs.decode(this.s, "rot13"), json.__doc__, re.__doc__, collections.__doc__,
                  argparse.__doc__])


def entry(content, special):
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": special}


def make(name, train, config, decoder):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        open(corpus, "w").write(TEXT)
        spm.SentencePieceTrainer.train(input=corpus, model_prefix=os.path.join(tmp, "m"), vocab_size=400,
                                       model_type="bpe", byte_fallback=True, num_threads=1,
                                       normalization_rule_name="identity", hard_vocab_limit=False,
                                       minloglevel=2, **train)
        shutil.copy(os.path.join(tmp, "m.model"), os.path.join(d, "tokenizer.model"))
        conv = os.path.join(tmp, "conv")
        os.makedirs(conv)
        shutil.copy(os.path.join(tmp, "m.model"), os.path.join(conv, "tokenizer.model"))
        json.dump(config, open(os.path.join(conv, "tokenizer_config.json"), "w"))
        AutoTokenizer.from_pretrained(conv).save_pretrained(conv)
        shutil.copy(os.path.join(conv, "tokenizer.json"), os.path.join(d, "tokenizer.json"))
    config["added_tokens_decoder"] = {str(i): entry(c, s) for i, (c, s) in decoder.items()}
    json.dump(config, open(os.path.join(d, "tokenizer_config.json"), "w"), indent=2, ensure_ascii=False)


PHI3_CHAT = ("{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
             "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
             "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}"
             "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")


def phi3():
    """Phi-3 ships Llama 2's tokenizer.model; its chat tokens are added tokens past the pieces."""
    src, d = os.path.join(OUT, "spm-llama2"), os.path.join(OUT, "spm-phi3")
    os.makedirs(d, exist_ok=True)
    shutil.copy(os.path.join(src, "tokenizer.model"), os.path.join(d, "tokenizer.model"))
    added = {400: ("<|endoftext|>", True, False), 401: ("<|assistant|>", True, True),
             402: ("<|placeholder1|>", False, True), 403: ("<|system|>", True, True),
             404: ("<|end|>", True, True), 405: ("<|placeholder2|>", True, True), 406: ("<|user|>", True, True)}
    tj = json.load(open(os.path.join(src, "tokenizer.json")))
    for i, (c, special, rstrip) in added.items():
        tj["added_tokens"].append({"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": rstrip,
                                   "normalized": False, "special": special})
    json.dump(tj, open(os.path.join(d, "tokenizer.json"), "w"), indent=2, ensure_ascii=False)
    config = {"add_bos_token": False, "add_eos_token": False, "bos_token": "<s>", "chat_template": PHI3_CHAT,
              "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>", "legacy": False,
              "model_max_length": 4096, "pad_token": "<|endoftext|>", "padding_side": "left", "sp_model_kwargs": {},
              "tokenizer_class": "LlamaTokenizer", "unk_token": "<unk>", "use_default_system_prompt": False}
    decoder = {0: ("<unk>", True), 1: ("<s>", True), 2: ("</s>", True)}
    decoder.update({i: (c, special) for i, (c, special, _) in added.items()})
    config["added_tokens_decoder"] = {str(i): entry(c, s) for i, (c, s) in decoder.items()}
    json.dump(config, open(os.path.join(d, "tokenizer_config.json"), "w"), indent=2, ensure_ascii=False)
    at = {c: i for i, (c, _, _) in added.items()}
    at["<|far|>"] = 420  # past vocab_size: the converter skips it
    json.dump(at, open(os.path.join(d, "added_tokens.json"), "w"), indent=2)
    AutoTokenizer.from_pretrained(d)  # loads as the released one does


ONLY = sys.argv[1:]
if not ONLY or "spm-llama2" in ONLY:
    make("spm-llama2", dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1),
         {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "clean_up_tokenization_spaces": False,
          "eos_token": "</s>", "legacy": False, "model_max_length": 1000000000000000019884624838656,
          "pad_token": None, "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizer", "unk_token": "<unk>",
          "use_default_system_prompt": False},
         {0: ("<unk>", True), 1: ("<s>", True), 2: ("</s>", True)})
if not ONLY or "spm-gemma" in ONLY:
    make("spm-gemma", dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
                           control_symbols=["<mask>"],
                           user_defined_symbols=["<start_of_turn>", "<end_of_turn>", "<unused0>", "▁▁"]),
         {"add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>", "clean_up_tokenization_spaces": False,
          "eos_token": "<eos>", "pad_token": "<pad>", "sp_model_kwargs": {}, "spaces_between_special_tokens": False,
          "tokenizer_class": "GemmaTokenizer", "unk_token": "<unk>", "use_default_system_prompt": False},
         {0: ("<pad>", True), 1: ("<eos>", True), 2: ("<bos>", True), 3: ("<unk>", True), 4: ("<mask>", False),
          5: ("<start_of_turn>", True), 6: ("<end_of_turn>", True), 7: ("<unused0>", False), 8: ("▁▁", False)})
if not ONLY or "spm-phi3" in ONLY:
    phi3()
