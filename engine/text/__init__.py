"""tandem.engine.text: Text: tokenizer and chat template, incremental detokenizer and stop strings, the
offline output processor.
"""
