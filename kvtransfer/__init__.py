"""kvtransfer"""
