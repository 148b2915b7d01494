"""compiled"""
