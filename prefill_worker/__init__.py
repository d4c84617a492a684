"""tandem.prefill_worker"""
