//! `train`: Horovod's ImageNet ResNet-50 example as one command. See `train --help`.

use std::process::ExitCode;

fn main() -> ExitCode {
    train::main_with(train::resnet_from_args)
}
