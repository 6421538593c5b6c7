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

Usage: gen-spm-fixtures.py   (needs sentencepiece, transformers; run from the repository root)"""
import codecs, collections, argparse, json, os, re, shutil, tempfile, this

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


make("spm-llama2", dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1),
     {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "clean_up_tokenization_spaces": False,
      "eos_token": "</s>", "legacy": False, "model_max_length": 1000000000000000019884624838656,
      "pad_token": None, "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizer", "unk_token": "<unk>",
      "use_default_system_prompt": False},
     {0: ("<unk>", True), 1: ("<s>", True), 2: ("</s>", True)})
make("spm-gemma", dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
                       control_symbols=["<mask>"],
                       user_defined_symbols=["<start_of_turn>", "<end_of_turn>", "<unused0>", "▁▁"]),
     {"add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>", "clean_up_tokenization_spaces": False,
      "eos_token": "<eos>", "pad_token": "<pad>", "sp_model_kwargs": {}, "spaces_between_special_tokens": False,
      "tokenizer_class": "GemmaTokenizer", "unk_token": "<unk>", "use_default_system_prompt": False},
     {0: ("<pad>", True), 1: ("<eos>", True), 2: ("<bos>", True), 3: ("<unk>", True), 4: ("<mask>", False),
      5: ("<start_of_turn>", True), 6: ("<end_of_turn>", True), 7: ("<unused0>", False), 8: ("▁▁", False)})
