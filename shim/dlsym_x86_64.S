/*
 * The shim's dlsym. glibc resolves RTLD_NEXT relative to the object that
 * called dlsym, found from the return address. A C wrapper that calls the
 * real dlsym would make the shim the caller and change what RTLD_NEXT
 * means for every library in the process. So the decision is made in C
 * (gs_dlsym_hook) and, when the shim has nothing to hand out, this code
 * jumps to the real dlsym with the caller's own return address still on
 * the stack: a tail call the compiler cannot be trusted to guarantee.
 */
	.text
	.globl	dlsym
	.type	dlsym, @function
dlsym:
	.cfi_startproc
	pushq	%rdi
	.cfi_adjust_cfa_offset 8
	pushq	%rsi
	.cfi_adjust_cfa_offset 8
	subq	$8, %rsp
	.cfi_adjust_cfa_offset 8
	call	gs_dlsym_hook
	addq	$8, %rsp
	.cfi_adjust_cfa_offset -8
	popq	%rsi
	.cfi_adjust_cfa_offset -8
	popq	%rdi
	.cfi_adjust_cfa_offset -8
	testq	%rax, %rax
	jz	1f
	/* 1 (GS_DLSYM_NONE in dispatch.c): the answer is "no symbol". */
	cmpq	$1, %rax
	jne	3f
	xorl	%eax, %eax
3:
	ret
1:
	/* glibc's dlsym could not be found: answer "no symbol" rather than jump to 0. */
	movq	gs_real_dlsym(%rip), %rax
	testq	%rax, %rax
	jz	2f
	jmpq	*%rax
2:
	ret
	.cfi_endproc
	.size	dlsym, .-dlsym

	.section .note.GNU-stack, "", @progbits
