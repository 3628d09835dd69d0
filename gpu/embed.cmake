# cmake -DIN=file -DOUT=file.c -DNAME=symbol -P embed.cmake: the bytes of IN as a C array NAME
# (with NAME_len), so that a binary carries its device kernels and needs no file beside it.
file(READ "${IN}" hex HEX)
string(LENGTH "${hex}" n)
math(EXPR bytes "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
string(REGEX REPLACE "(0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,)" "\\1\n" body "${body}")
file(WRITE "${OUT}" "/* generated from ${IN} by gpu/embed.cmake */\n#include <stddef.h>\n"
     "__attribute__((aligned(16))) const unsigned char ${NAME}[] = {\n${body}\n};\n"
     "const size_t ${NAME}_len = ${bytes};\n")
