#!/bin/sh
echo "Helo, world"
