"""Text as the models read it, shared by training and decoding: BPE tokenizers trained from text (bpe.py), chat
conversations rendered with the model's template or the simple one (chat.py), ``.txt`` / ``.jsonl`` files read as
documents (documents.py), large texts cut where the tokens provably stay the same (pieces.py), and documents turned
into token ids and loss masks (tokenize.py). It sits at the bottom of the package, beside tokenizer.py and hub.py.
"""
