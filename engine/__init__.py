"""tandem.engine"""
